"""Model folders from disk served across real worker processes answer as `transformers` does.

Tiny GPT-2, BERT and Llama folders (built by `transformers`, saved as
safetensors, nothing downloaded) are served in every mode by three workers
over ZeroMQ with a real Redis; each device reads only its shard of the folder.
The answers are compared with `transformers`' own forward of the same folder
(`from_pretrained`), and generated tokens with its greedy `generate`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from common.serving_messages import ServeSpec
from common.settings import CoordinatorSettings
from services.cli.serve import infer_request
from services.coordinator.service import Coordinator
from services.lib.galaxy import pretrained
from tests.cluster import LocalCluster
from tests.galaxy import hf_folders
from tests.integration.test_serving import Serving

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")

WORKERS = ["a", "b", "c"]
MODES = ["galaxy", "megatron", "sp", "local"]
PROMPTS = [[5, 17, 3, 50, 9, 9, 1, 42, 7, 7, 60, 2], [11, 4]]
NEW_TOKENS = 4
ATOL = 1e-4


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "gpt2": hf_folders.save(hf_folders.gpt2(), root / "gpt2"),
        "bert": hf_folders.save(hf_folders.bert(), root / "bert"),
        "bert-cls": hf_folders.save(hf_folders.bert(classes=3), root / "bert-cls", shard_kb=8),
        "llama": hf_folders.save(hf_folders.llama(), root / "llama", shard_kb=8),
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Serving]:
    """One cluster for the module: three workers stay up while each folder and mode is served."""
    name = f"test-{uuid.uuid4().hex[:10]}"
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"), redis_url, name)
    coord = Coordinator(
        CoordinatorSettings(bind=cluster.addr, redis_url=redis_url, cluster=name, heartbeat_s=0.3)
    )
    cluster.env["ASTEROID_MEMORY_BUDGET"] = str(256 << 20)
    try:
        cluster.start_workers(WORKERS)
        coord.wait_for_devices([*WORKERS], 60)  # type: ignore[list-item]
        yield Serving(cluster, coord)
        coord.shutdown_workers("test over")
        cluster.wait_workers_exit(30)
    finally:
        coord.close()
        cluster.close()
        r = redis.Redis.from_url(redis_url)
        keys = list(r.scan_iter(match=f"asteroid:{name}:*", count=1000))
        if keys:
            r.delete(*keys)
        r.close()


@pytest.fixture
def serving(cluster: Serving) -> Iterator[Serving]:
    yield cluster
    cluster.settle(cluster.serve_id)


def _reference(folder: Path) -> Any:
    """`transformers`' own model of the folder, in float32 eval mode."""
    auto = transformers.AutoModelForSequenceClassification
    arch = pretrained.read_config(folder)
    if arch.kind == "decoder":
        auto = transformers.AutoModelForCausalLM
    elif not arch.num_classes:
        auto = transformers.AutoModel
    return auto.from_pretrained(folder, attn_implementation="eager").float().eval()


def _spec(name: str, folder: Path, mode: str) -> ServeSpec:
    return ServeSpec(
        serve_id=f"{name}-{mode}",
        source="pretrained",
        path=str(folder),
        model=pretrained.read_shape(folder),
        mode=mode,
        seq_len=len(PROMPTS[0]),
    )


def _check_split(serving: Serving, spec: ServeSpec) -> None:
    """The job's plan really splits the model (heads, or rows for sp) over several devices."""
    raw = serving.coord.store.get_fields("job", spec.serve_id)["plan"]
    plan = json.loads(raw) if isinstance(raw, str | bytes) else raw
    assert plan["mode"] == spec.mode
    shares = plan["rows"] if spec.mode == "sp" else plan["heads"]
    if spec.mode != "local":
        assert sum(1 for n in shares if n) >= 2, plan


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_served_decoder_folder_answers_as_transformers_does(serving, folders, name, mode):
    folder = folders[name]
    spec = _spec(name, folder, mode)
    serving.start(spec)
    model = _reference(folder)
    for ids in PROMPTS:
        reply = infer_request(serving.cluster.addr, spec.serve_id, ids, new_tokens=NEW_TOKENS)
        assert reply.ok, reply.error
        _check_split(serving, spec)  # answered: the job runs on its plan
        x = torch.tensor([ids])
        with torch.no_grad():
            want = model(x).logits[0, -1]
            generated = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                pad_token_id=0,
            )[0, len(ids) :]
        got = torch.tensor(reply.logits)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert reply.tokens == generated.tolist()
    serving.stop(spec.serve_id)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["bert", "bert-cls"])
def test_a_served_encoder_folder_answers_as_transformers_does(serving, folders, name, mode):
    folder = folders[name]
    spec = _spec(name, folder, mode)
    serving.start(spec)
    model = _reference(folder)
    ids = PROMPTS[0]
    reply = infer_request(serving.cluster.addr, spec.serve_id, ids)
    assert reply.ok, reply.error
    _check_split(serving, spec)
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    # a classifier's logits; else the first position's hidden state
    want = out.logits[0] if name == "bert-cls" else out.last_hidden_state[0, 0]
    torch.testing.assert_close(torch.tensor(reply.logits), want, atol=ATOL, rtol=0)
    serving.stop(spec.serve_id)


def test_a_folder_missing_on_the_devices_fails_the_job_naming_it(serving, folders):
    spec = _spec("gpt2", folders["gpt2"], "galaxy").model_copy(
        update={"serve_id": "nowhere", "path": "/nowhere/gpt2"}
    )
    serving.start(spec)
    assert serving.thread is not None
    serving.thread.join(60)  # it fails as the devices load, before any request
    assert not serving.thread.is_alive()
    fields = serving.coord.store.get_fields("job", "nowhere")
    assert fields["state"] == "failed"
    assert "model folder '/nowhere/gpt2' is not a directory on this device" in fields["error"]
