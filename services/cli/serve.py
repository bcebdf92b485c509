"""`asteroid serve | infer`: a model served across the devices, and requests to it.

`serve` submits a serving job (a YAML serving spec: the model's shape and
source, the parallelism mode, the devices); the coordinator profiles the
devices, plans the split and loads the shards, and the job serves until
`asteroid cancel`. `infer` sends one request and prints the answer with its
latency. Programs use `infer_request` directly: one request, one reply.

A prompt given as text goes through the model folder's tokenizer with
`--model-dir` (its EOS ids then end generation, and the answer is decoded with
it); without one it is encoded as its UTF-8 bytes (token id = byte value), for
models built from a shape, which then need a vocabulary of at least 256.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from common.errors import AsteroidError, ConfigError
from common.exit_codes import ExitCode
from services.cli.console import CliConsole, shown
from services.cli.failure import fail as _fail
from services.cli.jobs import coordinator_of

if TYPE_CHECKING:
    from common.curve import CurveKeys
    from common.serving_messages import InferChunk, InferReply, ServeSpec
    from services.lib.text import TextModel

__all__ = [
    "infer",
    "infer_request",
    "load_serve_spec",
    "pretrained_fields",
    "serve",
    "stream_request",
]

console = CliConsole()

CoordinatorOpt = Annotated[
    str | None,
    typer.Option(
        help="Coordinator control address (default: ASTEROID_COORDINATOR, else the local cluster)."
    ),
]


def pretrained_fields(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """A pretrained spec's fields with its folder made absolute and its `model` read from it.

    A relative `path` is taken from `base` (the spec file's folder) and `~` is
    expanded, since every device must find the folder under the same absolute
    path. The shape comes from the folder's config.json when the spec gives none,
    and must equal it when the spec gives one; a folder that is only on the
    devices, not here, needs `model` in the spec. Other sources pass unchanged.

    Raises:
        ConfigError: The folder's config.json cannot be served, or differs from `model`.

    """
    if data.get("source") != "pretrained" or not isinstance(data.get("path"), str):
        return data
    folder = (base / Path(data["path"]).expanduser()).resolve()
    out = {**data, "path": str(folder)}
    given = out.get("model")
    if given is not None and not folder.is_dir():
        return out  # the devices check the folder against the shape
    from pydantic import ValidationError

    from common.serving_messages import TransformerShape
    from services.lib.galaxy.pretrained import read_shape

    shape = read_shape(folder)
    if given is None:
        return {**out, "model": shape.model_dump()}
    try:
        claimed = TransformerShape.model_validate(given)
    except ValidationError:
        return out  # reported field by field with the rest of the spec
    differ = {k: v for k, v in claimed.model_dump().items() if getattr(shape, k) != v}
    if differ:
        theirs = {k: getattr(shape, k) for k in differ}
        raise ConfigError(f"model {differ} differs from {folder}/config.json: {theirs}")
    return out


def load_serve_spec(path: Path) -> ServeSpec:
    """Read a serving spec from YAML or JSON; the error names the file and the field."""
    from common.serving_messages import ServeSpec
    from common.spec_files import load_spec_file

    spec = load_spec_file(
        path, ServeSpec, "serving spec", lambda data: pretrained_fields(data, path.parent)
    )
    if spec.model is not None:
        spec.model.config()  # a shape no plan can split is refused here, not on the devices
    return spec


def stream_request(
    address: str,
    serve_id: str,
    ids: list[int],
    new_tokens: int = 0,
    timeout_s: float = 120.0,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop: list[int] | None = None,
    stream: bool = True,
) -> Generator[InferChunk | InferReply, None, None]:
    """Run one request on serving job `serve_id`: its chunks (with `stream`), then its reply.

    With ASTEROID_KEYS set (the key set holding this operator's one secret key),
    the request goes over CURVE as that operator, identity NAME/SESSION.
    """
    from common.serving_messages import MAX_WAIT_S, InferRequest
    from services.lib.infer_client import stream_infer

    # the coordinator answers a request whose turn did not come in time, before we give up
    wait_s = min(max(timeout_s * 0.8, 0.1), MAX_WAIT_S)
    msg = InferRequest(
        serve_id=serve_id,
        ids=ids,
        new_tokens=new_tokens,
        wait_s=wait_s,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=stop or [],
        stream=stream,
    )
    return stream_infer(address, msg, _operator_keys(), timeout_s=timeout_s)


def infer_request(
    address: str,
    serve_id: str,
    ids: list[int],
    new_tokens: int = 0,
    timeout_s: float = 120.0,
    **sampling: Any,
) -> InferReply:
    """Run one request on serving job `serve_id` and return the coordinator's answer.

    `sampling`: `temperature`, `top_p`, `seed`, `stop` as `stream_request` takes them.
    """
    from common.serving_messages import InferReply

    answers = stream_request(
        address, serve_id, ids, new_tokens, timeout_s, **sampling, stream=False
    )
    with closing(answers):
        for answer in answers:
            if isinstance(answer, InferReply):
                return answer
    raise AsteroidError(f"the coordinator at {address} sent no infer_reply")


def _operator_keys() -> CurveKeys | None:
    import os

    from common.curve import load_keys

    keys_dir = os.environ.get("ASTEROID_KEYS")
    return load_keys(Path(keys_dir) if keys_dir else None, "operator")


_INPUT_REFUSALS = ("invalid", "no_job")
"""Refusals of an infer request that are the request's fault (exit CONFIG, not JOB_FAILED)."""


def serve(
    spec_file: Annotated[Path, typer.Argument(help="Serving spec (YAML).", metavar="SERVE.yaml")],
    coordinator: CoordinatorOpt = None,
    reply_timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait.")] = 15.0,
) -> None:
    """Serve a model across the devices (until `asteroid cancel SERVE_ID`)."""
    from common.serving_messages import ServeModel
    from services.cli.client import ask_coordinator

    try:
        spec = load_serve_spec(spec_file)
        address = coordinator_of(coordinator)
        reply = ask_coordinator(address, ServeModel(spec=spec), reply_timeout)
    except AsteroidError as exc:
        raise _fail(exc) from exc
    if not reply.ok:
        raise _fail(ConfigError(reply.error))
    console.print(
        f"serving job [cyan]{spec.serve_id}[/cyan] submitted to {address}; see it with "
        f"`asteroid status --job {spec.serve_id}`, ask it with `asteroid infer "
        f"{spec.serve_id} --ids 1,2,3`, stop it with `asteroid cancel {spec.serve_id}`"
    )


def _text_of(folder: Path | None) -> TextModel | None:
    """The tokenizer of the model folder `folder`, if one is named (ConfigError if unreadable)."""
    if folder is None:
        return None
    from services.lib.text import load_text  # the tokenizers library: only when asked for

    return load_text(folder)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise ConfigError(f"--ids takes integers separated by commas, got {text!r}") from None


def infer(
    serve_id: Annotated[str, typer.Argument(help="The serving job.")],
    ids: Annotated[str | None, typer.Option(help="Token ids, e.g. 5,17,3.")] = None,
    prompt: Annotated[
        str | None,
        typer.Option(help="Text: through --model-dir's tokenizer, else its UTF-8 bytes (0-255)."),
    ] = None,
    model_dir: Annotated[
        Path | None,
        typer.Option(
            help="The served model's folder: its tokenizer.json turns --prompt into ids and "
            "the answer back into text, and its EOS ids end generation."
        ),
    ] = None,
    generate: Annotated[int, typer.Option(min=0, help="Tokens to generate (decoders).")] = 0,
    show_logits: Annotated[int, typer.Option(min=0, help="Print this many output values.")] = 5,
    coordinator: CoordinatorOpt = None,
    timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds to wait for the answer.")
    ] = 120.0,
    temperature: Annotated[
        float, typer.Option(min=0.0, max=2.0, help="0: greedy; above: sampling.")
    ] = 0.0,
    top_p: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Sample from this much probability mass.")
    ] = 1.0,
    seed: Annotated[
        int, typer.Option(min=0, help="Seed of the sampling: same seed, same text.")
    ] = 0,
    stop: Annotated[
        str | None, typer.Option(help="Token ids that end generation, e.g. 50256.")
    ] = None,
    stream: Annotated[bool, typer.Option(help="Print tokens as they are generated.")] = False,
) -> None:
    """Send one request to a serving job and print the answer and its latency."""
    if (ids is None) == (prompt is None):
        raise _fail(ConfigError("give exactly one of --ids and --prompt"))
    from common.serving_messages import InferReply

    reply: InferReply | None = None
    try:
        text = _text_of(model_dir)
        stops = _parse_ids(stop) if stop else list(text.eos_ids if text else ())
        if ids is not None:
            tokens = _parse_ids(ids)
        else:
            tokens = text.encode(prompt or "") if text else list((prompt or "").encode())
        answers = stream_request(
            coordinator_of(coordinator),
            serve_id,
            tokens,
            generate,
            timeout,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stops,
            stream=stream,
        )
        with closing(answers):
            for answer in answers:
                if isinstance(answer, InferReply):
                    reply = answer
                else:
                    console.print(f"tokens: {answer.tokens}")
    except ValueError as exc:  # a tokenizer's complaint about the prompt
        raise _fail(ConfigError(str(exc))) from exc
    except AsteroidError as exc:
        raise _fail(exc) from exc
    if reply is None:
        raise _fail(AsteroidError("the coordinator sent no infer_reply"))
    if not reply.ok:
        code = ExitCode.CONFIG if reply.refusal in _INPUT_REFUSALS else ExitCode.JOB_FAILED
        raise _fail(ConfigError(reply.error), code)
    console.print(
        f"request {reply.request}: {len(tokens)} tokens in, latency {reply.latency_s * 1e3:.1f} ms"
        f" (queued {reply.queued_s * 1e3:.1f} ms)"
    )
    if reply.tokens:
        console.print(f"generated ids: {reply.tokens} (ended by {reply.finish_reason})")
        if text is not None:
            console.print(f"generated text: {shown(repr(text.decode(reply.tokens)))}")
        elif prompt is not None and all(t < 256 for t in reply.tokens):
            utf8 = bytes(reply.tokens).decode(errors="replace")
            console.print(f"generated text: {shown(repr(utf8))}")
    if reply.logits and show_logits:
        best = max(range(len(reply.logits)), key=reply.logits.__getitem__)
        head = ", ".join(f"{v:.4f}" for v in reply.logits[:show_logits])
        console.print(f"output: {len(reply.logits)} values, argmax {best}; first: [{head}]")
