"""The real `openai` client against `asteroid-gateway` over a model folder served by real workers.

A tiny Llama (grouped-query attention, RoPE; GPT-2 among the slow tests) saved
by `transformers` with a tokenizer trained here; three workers serve it, the
coordinator runs on a thread of the test, the gateway is its own process
started by its installed command. Answers are checked against `transformers`'
own greedy `generate` on the ids the chat template gives; bad requests get
their HTTP errors, a flood is held to the gateway's bound with 429s, a client
leaving mid-stream harms nothing, and the gateway stops cleanly on SIGTERM.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from typer.testing import CliRunner

from common.entry_points import service_command
from common.ports import free_port
from common.serving_messages import ServeSpec
from services.cli import app
from services.lib.galaxy import pretrained
from services.lib.text import TextModel, load_text
from tests.gateway.folders import byte_level_tokenizer, write_folder
from tests.integration.test_serving import Serving
from tests.integration.test_serving import serving as serving  # the fixture

pytestmark = pytest.mark.integration

KEY = "sk-gateway-test"
QUEUE = 2
CHAT = [
    {"role": "system", "content": "answer briefly"},
    {"role": "user", "content": "what does the quick brown fox do?"},
]


def _model_folder(folder: Path, kind: str) -> Path:
    """A 2-layer GPT-2, or Llama (GQA, RoPE), over the trained tokenizer's vocabulary."""
    import transformers

    tok = byte_level_tokenizer()
    ends = {"bos_token_id": tok.token_to_id("<s>"), "eos_token_id": tok.token_to_id("</s>")}
    if kind == "gpt2":
        config: Any = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=tok.get_vocab_size(), n_positions=128,
            attn_implementation="eager", **ends,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=48, vocab_size=tok.get_vocab_size(), max_position_embeddings=128,
            rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="eager", **ends,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder, safe_serialization=True)
    return write_folder(folder, tok)


def _reference(folder: Path, ids: list[int], new: int, text: TextModel) -> tuple[str, int]:
    """`transformers`' greedy answer to `ids`: its text and its token count (EOS left out)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    with torch.no_grad():
        out = (
            model.float()
            .eval()
            .generate(
                torch.tensor([ids]),
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=list(text.eos_ids),
                pad_token_id=text.eos_ids[0],
            )
        )
    tokens = [int(t) for t in out[0, len(ids) :]]
    if tokens and tokens[-1] in text.eos_ids:
        tokens = tokens[:-1]
    return text.decode(tokens), len(tokens)


class Gateway:
    """`asteroid-gateway` as a child process of the test's cluster."""

    def __init__(self, serving: Serving) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cluster = serving.cluster
        cluster.env["ASTEROID_API_KEY"] = KEY
        python, script = service_command("gateway")
        assert python
        args = [script, "--http-port", str(self.port), "--max-requests", str(QUEUE)]
        self.proc = cluster.spawn("gateway", [*args, "--request-timeout-s", "120"])
        self.cluster = cluster

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.cluster.log_tail("gateway")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        raise AssertionError(f"the gateway never answered\n{self.cluster.log_tail('gateway')}")

    def in_flight(self) -> int:
        return int(httpx.get(f"{self.url}/health", timeout=5).json()["in_flight"])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.cluster.wait("gateway", 30)


def _post(url: str, body: dict[str, Any], key: str = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)


@pytest.mark.parametrize("kind", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_the_openai_client_completes_and_streams_a_chat(
    serving: Serving, tmp_path: Path, kind: str
) -> None:
    gateway = Gateway(serving)  # first: its start overlaps the folder's making
    try:
        folder = _model_folder(tmp_path / kind, kind)
        text = load_text(folder)
        gateway.wait_ready()
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.APIStatusError) as none:  # no serving job yet
            client.chat.completions.create(model="llama", messages=CHAT)
        assert none.value.status_code == 503

        spec = ServeSpec(
            serve_id="llama",
            source="pretrained",
            path=str(folder),
            model=pretrained.read_shape(folder),
            mode="galaxy",
            seq_len=32,
        )
        serving.start(spec)
        assert [m.id for m in client.models.list()] == ["llama"]

        ids = text.encode_chat(CHAT)
        want, count = _reference(folder, ids, 12, text)
        whole = client.chat.completions.create(
            model="llama",
            messages=CHAT,
            temperature=0,
            max_tokens=12,
        )
        assert whole.choices[0].message.content == want
        assert whole.usage is not None
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), count)
        assert whole.choices[0].finish_reason == ("length" if count == 12 else "stop")

        stream = client.chat.completions.create(
            model="llama",
            messages=CHAT,
            temperature=0,
            max_tokens=12,
            stream=True,
        )
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(pieces) == want

        prompt = "the lazy dog"
        want_text, _ = _reference(folder, text.encode(prompt), 8, text)
        done = client.completions.create(model="llama", prompt=prompt, max_tokens=8, temperature=0)
        assert done.choices[0].text == want_text
        args = ["--model-dir", str(folder), "--prompt", prompt, "--generate", "8"]
        cli = CliRunner().invoke(
            app, ["infer", "llama", *args, "--coordinator", serving.cluster.addr]
        )
        assert cli.exit_code == 0, cli.output
        assert f"generated text: {want_text!r}" in " ".join(cli.output.split())  # the CLI alike

        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=f"{gateway.url}/v1", api_key="wrong", max_retries=0
            ).models.list()
        with pytest.raises(openai.BadRequestError, match="context"):
            client.chat.completions.create(model="llama", messages=CHAT, max_tokens=1000)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="llama", messages=CHAT, n=3)

        _flood(gateway, ids)
        _leave_mid_stream(gateway)
        again = client.chat.completions.create(
            model="llama",
            messages=CHAT,
            temperature=0,
            max_tokens=12,
        )
        assert again.choices[0].message.content == want  # unharmed by all of it
        serving.stop("llama")
    finally:
        code = gateway.stop()
    assert code == 0, gateway.cluster.log_tail("gateway")


def _flood(gateway: Gateway, ids: list[int]) -> None:
    """Ten times the bound at once: the excess refused with 429, every admitted one answered."""
    room = 128 - len(ids)
    long = {"model": "llama", "messages": CHAT, "max_tokens": min(room, 48), "temperature": 0.7}
    pool = ThreadPoolExecutor(10 * QUEUE)
    held = [pool.submit(_post, gateway.url, {**long, "seed": i}) for i in range(QUEUE)]
    deadline = time.monotonic() + 30
    while gateway.in_flight() < QUEUE and time.monotonic() < deadline:
        time.sleep(0.01)
    start = threading.Barrier(10 * QUEUE - QUEUE)

    def one() -> httpx.Response:
        start.wait(30)
        return _post(gateway.url, {**long, "max_tokens": 4})

    flood = [f.result(120) for f in [pool.submit(one) for _ in range(10 * QUEUE - QUEUE)]]
    still_held = not any(f.done() for f in held)
    codes = [r.status_code for r in flood]
    assert set(codes) <= {200, 429}, [r.text for r in flood]
    if still_held:  # every slot was taken while the flood came: all of it refused
        assert codes == [429] * len(flood)
    assert json.loads(next(r.text for r in flood if r.status_code == 429))["error"]["code"] in (
        "queue_full", "coordinator_queue_full"
    )  # fmt: skip
    assert [f.result(120).status_code for f in held] == [200] * QUEUE
    pool.shutdown()


def _leave_mid_stream(gateway: Gateway) -> None:
    """A client that hangs up after the first event leaves the gateway whole."""
    body = {"model": "llama", "messages": CHAT, "max_tokens": 24, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", f"{gateway.url}/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        first = next(response.iter_lines())
        assert first.startswith("data: ")
    deadline = time.monotonic() + 60
    while gateway.in_flight() and time.monotonic() < deadline:
        time.sleep(0.05)  # its slot is held until the coordinator answers, then given back
    assert gateway.in_flight() == 0
