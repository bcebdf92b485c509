"""The dashboard's HTTP routes: the page, its JSON, Prometheus's ``/metrics``.

Only GET, only reads. The page is one static file (inline CSS and script, no
CDN, no build step) that polls ``/api/state``; it writes what Redis holds into
the page as text, never as HTML, and the Content-Security-Policy lets it
load nothing from elsewhere. Bound to loopback, the server also refuses any
Host header but loopback's, so a web page elsewhere cannot read it through
DNS rebinding.
"""

from __future__ import annotations

from importlib.resources import files

from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from services.dashboard.prometheus import registry_for
from services.dashboard.state import ClusterReader, safe_state

__all__ = ["LOOPBACK_HOSTS", "create_app", "page_html"]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
"""Host headers a loopback-bound dashboard answers."""

TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
"""The classic text format `generate_latest` writes, under the name every scraper knows
(newer prometheus_client releases call it 1.0.0)."""

HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'",
}


def page_html() -> str:
    """The page, shipped inside the package beside this module."""
    return files("services.dashboard").joinpath("page.html").read_text(encoding="utf-8")


def create_app(reader: ClusterReader, loopback_only: bool = True) -> Starlette:
    """The routes over `reader`; `loopback_only` refuses Host headers but loopback's."""
    page = page_html()
    registry = registry_for(reader)

    async def index(_: Request) -> Response:
        return HTMLResponse(page, headers=HEADERS)

    async def state(request: Request) -> Response:
        job = request.query_params.get("job") or None
        status, body = await run_in_threadpool(safe_state, reader, job)
        return JSONResponse(body, status_code=status, headers=HEADERS)

    async def metrics(_: Request) -> Response:
        text = await run_in_threadpool(generate_latest, registry)
        return Response(text, headers={**HEADERS, "Content-Type": TEXT_FORMAT})

    async def healthz(_: Request) -> Response:
        return Response("ok\n", media_type="text/plain", headers=HEADERS)

    middleware = (
        [Middleware(TrustedHostMiddleware, allowed_hosts=list(LOOPBACK_HOSTS))]
        if loopback_only
        else []
    )
    return Starlette(
        routes=[
            Route("/", index, methods=["GET"]),
            Route("/api/state", state, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
        ],
        middleware=middleware,
    )
