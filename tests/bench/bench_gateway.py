"""What the HTTP gateway adds to a request: the same ids sent directly and through HTTP.

Three workers serve a tiny Llama folder (as in tests/integration/test_gateway.py);
each round sends one prompt of token ids for `--tokens` greedy tokens, once
through `services.lib.infer_client` straight to the coordinator and once as a
`/v1/completions` request to `asteroid-gateway` (whole, then streamed: time to
the first event). Prints the medians and the gateway's overhead.

    python -m tests.bench.bench_gateway [--rounds 10] [--tokens 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

from common.serving_messages import InferRequest, ServeModel, ServeSpec
from common.settings import CoordinatorSettings
from services.cli.client import ask_coordinator
from services.coordinator.service import Coordinator
from services.lib.galaxy import pretrained
from services.lib.infer_client import infer
from tests.cluster import LocalCluster
from tests.integration.test_gateway import KEY, _model_folder

PROMPT = [5, 17, 3, 50, 9, 9, 1, 42]


def _ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:7.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    redis_url = os.environ.get("ASTEROID_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    cluster = LocalCluster(tmp, redis_url, f"bench-{uuid.uuid4().hex[:8]}")
    coord = Coordinator(CoordinatorSettings(bind=cluster.addr, redis_url=redis_url,
                                            cluster=cluster.env["ASTEROID_CLUSTER"],
                                            heartbeat_s=0.3))  # fmt: skip
    try:
        cluster.start_workers(["a", "b", "c"])
        coord.wait_for_devices(["a", "b", "c"], 120)  # type: ignore[list-item]
        folder = _model_folder(tmp / "llama", "llama")
        shape = pretrained.read_shape(folder)
        spec = ServeSpec(serve_id="bench", source="pretrained", path=str(folder), model=shape,
                         mode="galaxy", seq_len=16)  # fmt: skip
        thread = threading.Thread(target=coord.serve, kwargs={"stop_after": "bench"}, daemon=True)
        thread.start()
        assert ask_coordinator(cluster.addr, ServeModel(spec=spec), 60).ok
        from common.entry_points import service_command
        from common.ports import free_port

        port = free_port()
        cluster.env["ASTEROID_API_KEY"] = KEY
        cluster.spawn("gateway", [service_command("gateway")[1], "--http-port", str(port)])
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        body = {"model": "bench", "prompt": PROMPT, "max_tokens": args.tokens, "temperature": 0}
        request = InferRequest(serve_id="bench", ids=PROMPT, new_tokens=args.tokens, logits=False)
        direct, whole, first = [], [], []
        for _ in range(args.rounds + 1):  # the first round warms up and is left out
            t = time.perf_counter()
            assert infer(cluster.addr, request, timeout_s=60).ok
            direct.append(time.perf_counter() - t)
            t = time.perf_counter()
            assert http.post("/v1/completions", json=body).status_code == 200
            whole.append(time.perf_counter() - t)
            t = time.perf_counter()
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)
                first.append(time.perf_counter() - t)
                for _line in lines:
                    pass
        direct, whole, first = direct[1:], whole[1:], first[1:]
        print(f"{args.rounds} rounds, {len(PROMPT)} prompt ids, {args.tokens} tokens, 3 workers")
        print(f"direct (infer_client):       {_ms(direct)}")
        print(f"gateway /v1/completions:     {_ms(whole)}")
        print(f"gateway stream, first event: {_ms(first)}")
        overhead = statistics.median(whole) - statistics.median(direct)
        print(f"gateway overhead:            {overhead * 1e3:7.1f} ms")
        http.close()
    finally:
        coord.stop("bench over")
        coord.shutdown_workers("bench over")
        coord.close()
        cluster.close()


if __name__ == "__main__":
    main()
