"""Our FedAvg against Flower's on the same digits split, model and local training.

Twice: the simulator's FedAvg, and FedAvg through our federation service with three
real homes (`tests.integration.test_federation`), whose Flower clients train each
home's local rounds the plain way (`tests.reference.reference_train`).

Flower's own server loop (`flwr.server.Server`: configure_fit, fit_clients, FedAvg's
aggregate_fit, centralised evaluate) drives real `NumPyClient`s in process, without ray
or sockets. Ours are only the proxy that hands a `FitIns` to a local client and a sort
that gives FedAvg the results in home order (see `OrderedFedAvg`).
Both sides train each home with `services.federation.simulate.local_train` and the same seeds, so
the two federations differ only in who averages the models.
"""

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

if os.environ.get("CI", "").strip().lower() not in ("true", "1", "yes"):  # CI: `make install`
    pytest.importorskip("flwr", reason="flwr is not installed: the Flower cross-check needs it")

from flwr.client import Client, NumPyClient
from flwr.common import (
    Code,
    Config,
    DisconnectRes,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetParametersIns,
    GetParametersRes,
    GetPropertiesIns,
    GetPropertiesRes,
    NDArrays,
    Parameters,
    ReconnectIns,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server import Server, SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg

from common.fl.data import (
    DIGIT_CLASSES,
    DigitsSplit,
    dirichlet_split,
    home_share,
    load_digits_split,
)
from common.zoo import ModelSpec, build_model
from services.federation.aggregate import fedavg
from services.federation.simulate import SimConfig, local_train, round_seed, simulate
from services.federation.strategies import make_strategy
from tests.integration import test_federation as fed
from tests.reference import reference_train

CONFIG = SimConfig(
    round_times=(1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
    dirichlet_alpha=0.5,
    updates=15,
    local_steps=10,
    seed=3,
)


def _model(cfg: SimConfig) -> nn.Module:
    spec = ModelSpec(name="fl_cnn", num_classes=DIGIT_CLASSES, options=dict(cfg.model_options))
    return build_model(spec, seed=cfg.seed).full()


def _to_state(keys: list[str], arrays: NDArrays) -> dict[str, Tensor]:
    return {k: torch.from_numpy(np.array(a, copy=True)) for k, a in zip(keys, arrays, strict=True)}


def _accuracy(model: nn.Module, state: Mapping[str, Tensor], x: Tensor, y: Tensor) -> float:
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


class HomeClient(NumPyClient):
    """One home: trains its split exactly as the simulator's homes do."""

    def __init__(self, home: int, x: Tensor, y: Tensor, cfg: SimConfig) -> None:
        self.home, self.x, self.y, self.cfg = home, x, y, cfg
        self.model = _model(cfg)
        self.keys = list(self.model.state_dict())

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, Config]:
        round_no = int(config["server_round"]) - 1
        gen = torch.Generator().manual_seed(round_seed(self.cfg.seed, self.home, round_no))
        state = _to_state(self.keys, parameters)
        trained = local_train(self.model, state, self.x, self.y, self.cfg, gen)
        return [v.numpy() for v in trained.values()], len(self.y), {}


class InProcessProxy(ClientProxy):
    """Hands the server's instructions to a client living in this process."""

    def __init__(self, cid: str, client: Client) -> None:
        super().__init__(cid)
        self.client = client
        # Flower fits on a pool thread, and torch's thread count is per thread (OpenMP):
        # train with the count of the thread that compares, or the sums run in another order
        self.threads = torch.get_num_threads()

    def get_properties(
        self, ins: GetPropertiesIns, timeout: float | None, group_id: int | None
    ) -> GetPropertiesRes:
        return self.client.get_properties(ins)

    def get_parameters(
        self, ins: GetParametersIns, timeout: float | None, group_id: int | None
    ) -> GetParametersRes:
        return self.client.get_parameters(ins)

    def fit(self, ins: FitIns, timeout: float | None, group_id: int | None) -> FitRes:
        torch.set_num_threads(self.threads)
        return self.client.fit(ins)

    def evaluate(
        self, ins: EvaluateIns, timeout: float | None, group_id: int | None
    ) -> EvaluateRes:
        return self.client.evaluate(ins)

    def reconnect(
        self, ins: ReconnectIns, timeout: float | None, group_id: int | None
    ) -> DisconnectRes:
        return DisconnectRes(reason="in process")


class OrderedFedAvg(FedAvg):
    """Flower's FedAvg, handed the results in home order.

    Flower collects results from a set of futures, so their order (hence float32
    round-off) changes from run to run, and SGD amplifies it over rounds (measured:
    final weights up to 2e-2 apart, mid-run accuracy up to 4 points). Our simulator
    sums in home order; giving Flower the same order isolates the averaging itself.
    """

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        ordered = sorted(results, key=lambda r: int(r[0].cid))
        return super().aggregate_fit(server_round, ordered, failures)


def flower_fedavg(
    model: nn.Module, clients: list[Client], rounds: int, data: DigitsSplit
) -> tuple[list[float], list[dict[str, Tensor]]]:
    """Flower FedAvg from `model`'s weights over `clients`: accuracy and model per round."""
    keys = list(model.state_dict())
    initial = [v.detach().numpy().copy() for v in model.state_dict().values()]
    models: list[dict[str, Tensor]] = []

    def evaluate(rnd: int, arrays: NDArrays, _: Config) -> tuple[float, Config]:
        models.append(_to_state(keys, arrays))
        return 0.0, {"accuracy": _accuracy(model, models[-1], data.test_x, data.test_y)}

    strategy = OrderedFedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=len(clients),
        min_available_clients=len(clients),
        initial_parameters=ndarrays_to_parameters(initial),
        on_fit_config_fn=lambda rnd: {"server_round": rnd},
        evaluate_fn=evaluate,
    )
    manager = SimpleClientManager()
    for h, client in enumerate(clients):
        manager.register(InProcessProxy(str(h), client))
    server = Server(client_manager=manager, strategy=strategy)
    server.set_max_workers(1)  # one torch thread at a time; results do not depend on it
    history, _ = server.fit(num_rounds=rounds, timeout=None)
    accuracies = [float(a) for _, a in history.metrics_centralized["accuracy"]]
    return accuracies, models


def run_flower(cfg: SimConfig, data: DigitsSplit) -> tuple[list[float], list[dict[str, Tensor]]]:
    """Flower FedAvg over every home for ``cfg.updates`` rounds: accuracy and model per round."""
    homes = len(cfg.round_times)
    parts = dirichlet_split(data.train_y, homes, cfg.dirichlet_alpha, cfg.seed, cfg.min_size)
    clients = [
        HomeClient(h, data.train_x[part], data.train_y[part], cfg).to_client()
        for h, part in enumerate(parts)
    ]
    return flower_fedavg(_model(cfg), clients, cfg.updates, data)


class JobHomeClient(NumPyClient):
    """A home that trains as our homes' local jobs do, computed the plain way.

    Piece N of a home's job (the N-th federated round, from 0) is a job of
    `LOCAL_ROUNDS` rounds seeded `JOB_SEED + N + 1`, on the home's digits share.
    """

    def __init__(self, home: int) -> None:
        self.home = home
        self.keys = list(build_model(ModelSpec.model_validate(fed.MODEL), 0).full().state_dict())
        self.size = len(home_share(fed.HOMES, home, fed.ALPHA, 0, 10)[1])

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, Config]:
        piece = int(config["server_round"]) - 1
        trained, _ = reference_train(
            fed.MODEL,
            fed.JOB_SEED + piece + 1,
            fed.BATCH,
            fed.LOCAL_ROUNDS,
            fed.OPTIMIZER,
            dataset=fed.digits(self.home),
            initial=_to_state(self.keys, parameters),
        )
        return [v.numpy() for v in trained.values()], self.size, {}


@pytest.fixture(scope="module")
def digits() -> DigitsSplit:
    return load_digits_split(seed=CONFIG.seed)


def _flat(state: Mapping[str, Tensor]) -> Tensor:
    return torch.cat([v.flatten().double() for v in state.values()])


def test_flower_fedavg_matches_ours_round_by_round(digits: DigitsSplit) -> None:
    ours = simulate(make_strategy("fedavg"), CONFIG, digits)
    flower_acc, flower_models = run_flower(CONFIG, digits)
    our_acc = [p.accuracy for p in ours.curve]
    assert len(flower_acc) == len(our_acc) == CONFIG.updates + 1
    assert flower_acc[0] == our_acc[0]  # the same initial model
    assert our_acc[-1] > 0.6  # it learned: the comparison is not between two chance levels
    assert abs(flower_acc[-1] - our_acc[-1]) <= 0.01  # the criterion
    assert flower_acc[:4] == our_acc[:4]  # while the gap is ~1e-7 it moves no prediction
    # Flower sums float32 in place, we in float64: ~1e-7 apart after a round, a gap
    # that 10 SGD steps a round amplify (measured: 6e-8 after 5 rounds, 1.2% relative
    # after 15). Accuracies stay equal for the first rounds, then part by up to a few
    # points mid-run, depending on the thread count and the installed libraries' sums
    # (1.6 and 3.1 points measured on earlier package sets, 4.9 on today's), and meet
    # again at the end (the criterion above); so mid-run rounds are not compared.
    # after one round the models differ only by the averaging's precision; later rounds
    # can flip a max-pool's choice on a 1e-7 difference (seen: 1e-4 after 5 rounds with
    # one torch thread, 6e-8 with two), so the per-round comparison is by accuracy above
    early = simulate(make_strategy("fedavg"), replace(CONFIG, updates=1), digits)
    for key, value in early.final_state.items():
        torch.testing.assert_close(flower_models[1][key], value, rtol=1e-5, atol=1e-6)
    final, mine = _flat(flower_models[-1]), _flat(ours.final_state)
    assert float((final - mine).norm() / mine.norm()) < 0.05


def test_one_flower_aggregation_equals_our_fedavg(digits: DigitsSplit) -> None:
    cfg = SimConfig(round_times=(1.0, 2.0, 3.0), updates=1, local_steps=2, seed=3)
    parts = dirichlet_split(digits.train_y, 3, cfg.dirichlet_alpha, cfg.seed, cfg.min_size)
    model = _model(cfg)
    keys = list(model.state_dict())
    init = ndarrays_to_parameters([v.detach().numpy().copy() for v in model.state_dict().values()])
    results: list[tuple[ClientProxy, FitRes]] = []
    for h, part in enumerate(parts):
        client = HomeClient(h, digits.train_x[part], digits.train_y[part], cfg).to_client()
        res = client.fit(FitIns(init, {"server_round": 1}))
        assert res.status.code == Code.OK and res.num_examples == len(part)
        results.append((InProcessProxy(str(h), client), res))
    merged, _ = FedAvg().aggregate_fit(1, results, [])
    assert merged is not None
    flower = _to_state(keys, parameters_to_ndarrays(merged))
    states = [_to_state(keys, parameters_to_ndarrays(r.parameters)) for _, r in results]
    ours = fedavg(states, [len(p) for p in parts])
    for key, value in ours.items():
        torch.testing.assert_close(flower[key], value, rtol=1e-6, atol=1e-7)


@pytest.mark.integration
def test_fedavg_through_our_service_matches_flower(
    tmp_path: Any, redis_url: str, cluster_name: str, budget: Any
) -> None:
    federation = fed.Federated(tmp_path, redis_url, cluster_name, budget)
    try:
        federation.start("fedavg", updates=fed.UPDATES)
        federation.wait()
        ours = [float(e["accuracy"]) for e in federation.curve()]
    finally:
        federation.close()
    model = build_model(ModelSpec.model_validate(fed.MODEL), 1).full()  # the federation's seed
    clients = [JobHomeClient(h).to_client() for h in range(fed.HOMES)]
    # the homes' workers train on one thread each (the cluster's ASTEROID_THREADS): so do
    # Flower's clients, whatever count an earlier test left this process (sums' order)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        theirs, _ = flower_fedavg(model, clients, fed.UPDATES, load_digits_split(seed=0))
    finally:
        torch.set_num_threads(threads)
    assert len(ours) == len(theirs) == fed.UPDATES + 1
    assert ours[0] == theirs[0]  # the same initial model, scored on the same held-out part
    assert ours[-1] > 0.6  # it learned: not two chance levels compared
    # equal while round-off is small; then the homes' micro-batched steps (two of 16 at lr
    # 0.3) and the plain whole-batch ones part by round-off that SGD amplifies (measured
    # with one thread each: 0.866 against 0.840 after 12 updates; the mean itself is
    # checked exactly in tests/integration/test_federation.py)
    assert ours[:6] == theirs[:6], (ours, theirs)
    assert abs(ours[-1] - theirs[-1]) <= 0.03, (ours, theirs)
