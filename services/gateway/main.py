"""`asteroid-gateway`: serve the running serving job over OpenAI's HTTP API until stopped.

The HTTP server runs on a thread of its own (`services.lib.http_serve`), so the
service's stop (SIGTERM, Ctrl-C) ends it cleanly: requests in flight finish,
then the server closes.

Exit codes: 0 stopped by SIGTERM/SIGINT after serving; 2 invalid settings (no
API key for an address beyond loopback, a --keys directory without an operator
key, a port taken); 130 a second signal (`common.exit_codes.ExitCode`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from functools import partial

from common.bootstrap import Stop, run_service
from common.curve import CurveKeys, is_loopback, load_keys
from common.errors import ConfigError
from common.exit_codes import ExitCode
from common.extras import require
from common.locate import with_redis
from common.logging import get_logger
from common.serving_messages import InferChunk, InferReply, InferRequest
from common.store import Store
from services.gateway.app import Limits, create_app
from services.gateway.backend import Gate, Infer, Streamer
from services.gateway.served import Resolver, find_served
from services.gateway.settings import GatewaySettings
from services.lib.http_serve import serve_http

__all__ = ["coordinator_infer", "main"]

log = get_logger(__name__)

STOP_GRACE_S = 10
"""Longest the HTTP server may take to finish its requests after a stop (then they are cut)."""


def coordinator_infer(address: str, keys: CurveKeys | None) -> Infer:
    """Requests sent to the coordinator at `address`, as `keys`' operator when given."""
    from services.lib.infer_client import stream_infer

    def infer(request: InferRequest, timeout_s: float) -> Iterator[InferChunk | InferReply]:
        return iter(stream_infer(address, request, keys=keys, timeout_s=timeout_s))

    return infer


def _serve(settings: GatewaySettings, stop: Stop) -> ExitCode:
    require("uvicorn", "the gateway")
    require("starlette", "the gateway")
    keys = load_keys(settings.keys, "operator", settings.operator)
    api_keys = settings.api_keys()
    if not api_keys and not is_loopback(f"tcp://{settings.http_host}:{settings.http_port}"):
        raise ConfigError(
            f"the gateway listens on {settings.http_host}, beyond this machine: give it an API key "
            "(ASTEROID_API_KEY or --api-key-file)"
        )
    if not api_keys:
        log.warning("no API key: any program on this machine may use the gateway")
    settings = with_redis(settings, keys, "operator", stop=stop.is_set)
    store = Store(settings.redis_url, settings.cluster)
    find = partial(find_served, store, settings.serve_id, settings.model_dir, settings.model_name)
    gate = Gate(settings.max_requests)
    streamer = Streamer(coordinator_infer(settings.coordinator, keys), gate)
    limits = Limits(
        api_keys=tuple(api_keys),
        max_body_bytes=settings.max_body_bytes,
        timeout_s=settings.request_timeout_s,
        default_max_tokens=settings.default_max_tokens,
    )
    app = create_app(streamer, Resolver(find), limits)

    def listening(url: str) -> None:
        log.info("gateway listening", url=url, coordinator=settings.coordinator,
                 queue=settings.max_requests)  # fmt: skip

    try:
        serve_http(app, settings.http_host, settings.http_port, stop, STOP_GRACE_S,
                   "the gateway", listening)  # fmt: skip
    finally:
        streamer.close()
    log.info("gateway stopped", signal=stop.signal)
    return ExitCode.OK


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of `asteroid-gateway`."""
    sys.exit(run_service("gateway", GatewaySettings, _serve, argv))


if __name__ == "__main__":
    main()
