"""`asteroid serve | infer`: a model served across the devices, and requests to it.

`serve` submits a serving job (a YAML serving spec: the model's shape and
source, the parallelism mode, the devices); the coordinator profiles the
devices, plans the split and loads the shards, and the job serves until
`asteroid cancel`. `infer` sends one request and prints the answer with its
latency. Programs use `infer_request` directly: one request, one reply.

A prompt given as text is encoded as its UTF-8 bytes (token id = byte value),
a tokenizer that needs no download; such a model needs a vocabulary of at
least 256. Generated ids below 256 are decoded the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from common.errors import AsteroidError, ConfigError
from common.exit_codes import ExitCode
from services.cli.console import CliConsole, shown

if TYPE_CHECKING:
    from common.serving_messages import InferReply, ServeSpec

__all__ = ["infer", "infer_request", "load_serve_spec", "serve"]

console = CliConsole()

CoordinatorOpt = Annotated[
    str | None,
    typer.Option(help="Coordinator control address (default: ASTEROID_COORDINATOR)."),
]


def load_serve_spec(path: Path) -> ServeSpec:
    """Read a serving spec from YAML or JSON; the error names the file and the field."""
    from common.serving_messages import ServeSpec
    from common.spec_files import load_spec_file

    spec = load_spec_file(path, ServeSpec, "serving spec")
    if spec.model is not None:
        spec.model.config()  # a shape no plan can split is refused here, not on the devices
    return spec


def infer_request(
    address: str, serve_id: str, ids: list[int], new_tokens: int = 0, timeout_s: float = 120.0
) -> InferReply:
    """Run one request on serving job `serve_id` and return the coordinator's answer."""
    from common.serving_messages import MAX_WAIT_S, InferReply, InferRequest
    from services.cli.client import request

    # the coordinator answers a request whose turn did not come in time, before we give up
    wait_s = min(max(timeout_s * 0.8, 0.1), MAX_WAIT_S)
    msg = InferRequest(serve_id=serve_id, ids=ids, new_tokens=new_tokens, wait_s=wait_s)
    reply = request(address, msg, InferReply, timeout_s).msg
    if not isinstance(reply, InferReply):  # request returns only the kind asked for
        raise AsteroidError(f"expected an infer_reply, got {reply.type}")
    return reply


def _fail(exc: Exception, code: ExitCode = ExitCode.CONFIG) -> typer.Exit:
    console.print(f"[red]error:[/red] {shown(exc)}")  # a refusal quotes the coordinator
    return typer.Exit(int(code))


def _coordinator(address: str | None) -> str:
    from common.settings import CommonSettings

    return address or CommonSettings().coordinator


def serve(
    spec_file: Annotated[Path, typer.Argument(help="Serving spec (YAML).", metavar="SERVE.yaml")],
    coordinator: CoordinatorOpt = None,
    reply_timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait.")] = 15.0,
) -> None:
    """Serve a model across the devices (until `asteroid cancel SERVE_ID`)."""
    from common.serving_messages import ServeModel
    from services.cli.client import ask_coordinator

    address = _coordinator(coordinator)
    try:
        spec = load_serve_spec(spec_file)
        reply = ask_coordinator(address, ServeModel(spec=spec), reply_timeout)
    except AsteroidError as exc:
        raise _fail(exc) from exc
    if not reply.ok:
        raise _fail(ConfigError(reply.error))
    console.print(
        f"serving job [cyan]{spec.serve_id}[/cyan] submitted to {address}; "
        f"follow it with `asteroid status {spec.serve_id}`"
    )


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise ConfigError(f"--ids takes integers separated by commas, got {text!r}") from None


def infer(
    serve_id: Annotated[str, typer.Argument(help="The serving job.")],
    ids: Annotated[str | None, typer.Option(help="Token ids, e.g. 5,17,3.")] = None,
    prompt: Annotated[
        str | None, typer.Option(help="Text, sent as its UTF-8 bytes (ids 0-255).")
    ] = None,
    generate: Annotated[int, typer.Option(min=0, help="Tokens to generate (decoders).")] = 0,
    show_logits: Annotated[int, typer.Option(min=0, help="Print this many output values.")] = 5,
    coordinator: CoordinatorOpt = None,
    timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds to wait for the answer.")
    ] = 120.0,
) -> None:
    """Send one request to a serving job and print the answer and its latency."""
    if (ids is None) == (prompt is None):
        raise _fail(ConfigError("give exactly one of --ids and --prompt"), ExitCode.CONFIG)
    try:
        tokens = _parse_ids(ids) if ids is not None else list((prompt or "").encode())
        reply = infer_request(_coordinator(coordinator), serve_id, tokens, generate, timeout)
    except AsteroidError as exc:
        raise _fail(exc) from exc
    if not reply.ok:
        raise _fail(ConfigError(reply.error), ExitCode.JOB_FAILED)
    console.print(
        f"request {reply.request}: {len(tokens)} tokens in, latency {reply.latency_s * 1e3:.1f} ms"
        f" (queued {reply.queued_s * 1e3:.1f} ms)"
    )
    if reply.tokens:
        console.print(f"generated ids: {reply.tokens}")
        if prompt is not None and all(t < 256 for t in reply.tokens):
            text = bytes(reply.tokens).decode(errors="replace")
            console.print(f"generated text: {shown(repr(text))}")
    if reply.logits and show_logits:
        best = max(range(len(reply.logits)), key=reply.logits.__getitem__)
        head = ", ".join(f"{v:.4f}" for v in reply.logits[:show_logits])
        console.print(f"output: {len(reply.logits)} values, argmax {best}; first: [{head}]")
