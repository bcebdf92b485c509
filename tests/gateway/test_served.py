"""Which model the gateway answers with, read from the job records in a real Redis."""

from __future__ import annotations

import pytest

from common.records.documents import put_jobspec
from common.records.jobs import index_job, write_job
from common.serving_messages import ServeSpec, TransformerShape
from common.store import Store
from services.gateway.backend import GatewayError
from services.gateway.served import find_served
from tests.gateway.folders import write_folder

SHAPE = TransformerShape(
    kind="decoder", layers=2, hidden=32, heads=4, ffn=64, vocab_size=512, max_positions=96
)


def _job(store: Store, jid: str, state: str, spec: ServeSpec, when: float) -> None:
    put_jobspec(store, jid, spec.model_dump(mode="json"))
    write_job(store, jid, state=state, kind="serve")
    index_job(store, jid, when)


@pytest.fixture
def store(redis_url, cluster_name):
    return Store(redis_url, cluster_name)


def test_the_newest_running_serving_job_with_its_folder(store, tmp_path):
    folder = write_folder(tmp_path / "m")
    older = ServeSpec(serve_id="old", source="transformers", model=SHAPE)
    _job(store, "old", "running", older, 1.0)
    spec = ServeSpec(serve_id="new", source="pretrained", path=str(folder), model=SHAPE)
    _job(store, "new", "running", spec, 2.0)
    _job(store, "gone", "cancelled", spec, 3.0)
    served = find_served(store, None, None, None)
    assert (served.serve_id, served.name, served.max_positions) == ("new", "new", 96)
    assert served.text.folder == folder and served.answers_to("new")
    named = find_served(store, "old", folder, "tiny")  # a non-folder source: --model-dir
    assert (named.serve_id, named.name) == ("old", "tiny") and named.answers_to("old")


def test_no_job_no_folder_or_a_tokenizer_beyond_the_vocabulary_is_503(store, tmp_path):
    with pytest.raises(GatewayError, match="no serving job is running") as none:
        find_served(store, None, None, None)
    assert none.value.status == 503
    _job(store, "bare", "running", ServeSpec(serve_id="bare", model=SHAPE), 1.0)
    with pytest.raises(GatewayError, match="--model-dir"):
        find_served(store, None, None, None)
    with pytest.raises(GatewayError, match=r"no tokenizer\.json"):
        find_served(store, None, tmp_path, None)
    small = SHAPE.model_copy(update={"vocab_size": 50})
    _job(store, "small", "running", ServeSpec(serve_id="small", model=small), 2.0)
    with pytest.raises(GatewayError, match="beyond the served model's vocabulary of 50"):
        find_served(store, "small", write_folder(tmp_path / "m"), None)
    with pytest.raises(GatewayError, match="no spec"):
        find_served(store, "nothing", None, None)
