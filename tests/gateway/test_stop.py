"""`asteroid-gateway` stops on SIGTERM even with a request waiting on a silent coordinator."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from common.entry_points import service_command
from common.ports import free_port
from common.records.documents import put_jobspec
from common.serving_messages import ServeSpec, TransformerShape
from common.store import Store
from tests.cluster import LocalCluster
from tests.gateway.folders import write_folder

pytestmark = pytest.mark.integration

SHAPE = TransformerShape(
    kind="decoder", layers=2, hidden=32, heads=4, ffn=64, vocab_size=512, max_positions=64
)


def test_a_stop_does_not_wait_for_a_coordinator_that_never_answers(
    tmp_path: Path, redis_url: str, cluster_name: str
) -> None:
    folder = write_folder(tmp_path / "model")
    spec = ServeSpec(serve_id="quiet", source="transformers", model=SHAPE)
    put_jobspec(Store(redis_url, cluster_name), "quiet", spec.model_dump(mode="json"))
    cluster = LocalCluster(tmp_path, redis_url, cluster_name)  # its address: nobody listens
    port = free_port()
    args = ["--http-port", str(port), "--serve-id", "quiet", "--model-dir", str(folder)]
    proc = cluster.spawn("gateway", [service_command("gateway")[1], *args])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, cluster.log_tail("gateway")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        answers: list[object] = []

        def ask() -> None:
            body = {"model": "quiet", "messages": [{"role": "user", "content": "the fox"}]}
            try:
                answers.append(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60))
            except httpx.HTTPError as exc:
                answers.append(exc)

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        while httpx.get(f"{url}/health", timeout=5).json()["in_flight"] < 1:
            assert time.monotonic() < deadline, "the request never reached the gateway"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        code = cluster.wait("gateway", 30)  # its grace is 10 s; the request's timeout 300 s
        asker.join(30)
    finally:
        cluster.close()
    assert code == 0, cluster.log_tail("gateway")
    (answer,) = answers  # the client is cut off, not left waiting
    assert not isinstance(answer, httpx.Response) or answer.status_code >= 500, answer
