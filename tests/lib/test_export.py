from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from common.checkpoint import commit_checkpoint, save_stage
from common.errors import CheckpointError, ConfigError
from common.job import JobSpec
from common.store import Store
from common.zoo import ModelSpec, build_model
from services.lib.export import ExportInfo, committed_rounds, export_weights

CNN = ModelSpec(name="small_cnn", options={"width": 4})
BATCHNORM = ModelSpec(name="mobilenet_v2", options={"width_mult": 0.1})


def submit(store: Store, job: JobSpec) -> None:
    """Store the job spec where the coordinator keeps it."""
    store.put_json(job.model_dump(mode="json"), "jobspec", job.job_id)


def train_and_checkpoint(
    store: Store, job: JobSpec, round_no: int, steps: int
) -> dict[str, torch.Tensor]:
    """Train two stages `steps` times, checkpoint them as their leaders do; the full state."""
    zoo = build_model(job.model, job.seed)
    cut = len(zoo.layers) // 2
    ranges = ((0, cut), (cut, len(zoo.layers)))
    stages = [zoo.stage(a, b) for a, b in ranges]
    opts = [torch.optim.SGD(s.parameters(), lr=0.1, momentum=0.9) for s in stages]
    gen = torch.Generator().manual_seed(round_no)
    for _ in range(steps):
        x, y = torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 10, (4,), generator=gen)
        loss = nn.functional.cross_entropy(stages[1](stages[0](x)), y)
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
    for (start, _), stage, opt in zip(ranges, stages, opts, strict=True):
        save_stage(store, job.job_id, round_no, stage, opt, start)
    commit_checkpoint(store, job.job_id, round_no, len(zoo.layers))
    return {k: v.clone() for k, v in zoo.full().state_dict().items()}


def load_exported(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(path)
    loaded = torch.load(path, weights_only=True)
    assert isinstance(loaded, dict)
    return loaded


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("spec", [CNN, BATCHNORM], ids=["small_cnn", "batchnorm"])
def test_export_loads_strictly_into_a_fresh_model(
    store: Store, tmp_path: Path, spec: ModelSpec, suffix: str
) -> None:
    job = JobSpec(job_id="exp", model=spec, seed=4)
    submit(store, job)
    source = train_and_checkpoint(store, job, 3, steps=2)
    path = tmp_path / f"weights{suffix}"

    info = export_weights(store, "exp", path)

    assert info == ExportInfo(job="exp", round=3, path=path, tensors=len(source))
    fresh = build_model(spec, job.seed).full()
    assert not all(torch.equal(v, source[k]) for k, v in fresh.state_dict().items())
    fresh.load_state_dict(load_exported(path), strict=True)
    assert_same_state(fresh.state_dict(), source)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_safetensors_metadata_names_job_round_and_model(store: Store, tmp_path: Path) -> None:
    job = JobSpec(job_id="meta", model=CNN)
    submit(store, job)
    train_and_checkpoint(store, job, 2, steps=1)
    path = tmp_path / "w.safetensors"
    export_weights(store, "meta", path)
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    assert (meta["job"], meta["round"]) == ("meta", "2")
    assert ModelSpec.model_validate_json(meta["model"]) == CNN


def test_newest_round_by_default_any_committed_round_on_request(
    store: Store, tmp_path: Path
) -> None:
    job = JobSpec(job_id="two", model=CNN)
    submit(store, job)
    older = train_and_checkpoint(store, job, 2, steps=1)
    newer = train_and_checkpoint(store, job, 5, steps=3)
    assert committed_rounds(store, "two") == [2, 5]

    assert export_weights(store, "two", tmp_path / "new.pt").round == 5
    assert_same_state(load_exported(tmp_path / "new.pt"), newer)
    assert export_weights(store, "two", tmp_path / "old.pt", round_no=2).round == 2
    assert_same_state(load_exported(tmp_path / "old.pt"), older)


def test_unknown_job(store: Store, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown job 'nope'"):
        export_weights(store, "nope", tmp_path / "w.pt")


def test_job_without_checkpoint(store: Store, tmp_path: Path) -> None:
    submit(store, JobSpec(job_id="fresh", model=CNN))
    with pytest.raises(ConfigError, match="job 'fresh' has no committed checkpoint yet"):
        export_weights(store, "fresh", tmp_path / "w.pt")


def test_missing_or_uncommitted_round_lists_the_committed_ones(
    store: Store, tmp_path: Path
) -> None:
    job = JobSpec(job_id="gaps", model=CNN)
    submit(store, job)
    train_and_checkpoint(store, job, 2, steps=1)
    train_and_checkpoint(store, job, 5, steps=1)
    zoo = build_model(CNN, 0)
    save_stage(store, "gaps", 7, zoo.full(), None, 0)  # written, never committed
    for round_no in (3, 7):
        with pytest.raises(
            ConfigError,
            match=rf"no committed checkpoint of round {round_no} \(committed rounds: 2, 5\)",
        ):
            export_weights(store, "gaps", tmp_path / "w.pt", round_no=round_no)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["w.bin", "w", "w.safetensors.tmp"])
def test_unknown_suffix(store: Store, tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match=r"must end in \.safetensors or \.pt"):
        export_weights(store, "any", tmp_path / name)


def test_checkpoint_of_another_model_is_refused(store: Store, tmp_path: Path) -> None:
    job = JobSpec(job_id="swap", model=CNN)
    train_and_checkpoint(store, job, 1, steps=1)
    submit(store, job.model_copy(update={"model": ModelSpec(name="small_cnn")}))
    with pytest.raises(CheckpointError, match=r"0\.conv\.weight has shape \(4, 3, 3, 3\)"):
        export_weights(store, "swap", tmp_path / "w.pt")
    submit(store, job.model_copy(update={"model": ModelSpec(name="mlp", options={"depth": 6})}))
    with pytest.raises(CheckpointError, match=r"does not match the model: missing \['0\.fc\.bias'"):
        export_weights(store, "swap", tmp_path / "w.pt")
