"""A model folder's text side: its tokenizer, its end-of-sequence ids and its chat template.

The served model sees token ids; people and programs send text. A Hugging
Face-style folder says how to turn one into the other: ``tokenizer.json`` (read
by the `tokenizers` library, no Python from the folder runs), the EOS ids in
``config.json``, ``generation_config.json`` or ``tokenizer_config.json``, and a
Jinja chat template in ``chat_template.jinja`` or ``tokenizer_config.json``.
The template is the folder's, the messages are a stranger's: it is rendered in
Jinja's immutable sandbox, as transformers does, so neither can reach Python.
A folder without ``tokenizer.json`` is refused: byte-valued ids would be
nonsense to a pretrained model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.extras import require

__all__ = [
    "FALLBACK_TEMPLATE",
    "MAX_MESSAGES",
    "MAX_STOP_IDS",
    "MAX_TEXT_CHARS",
    "IncrementalDecoder",
    "TextModel",
    "load_text",
]

MAX_MESSAGES = 256
"""Most messages one chat may hold."""
MAX_TEXT_CHARS = 1 << 20
"""Longest text encoded at once (a prompt, a rendered chat): far beyond any model's positions."""
MAX_STOP_IDS = 16
"""Most end-of-sequence ids taken from a folder (the wire's bound on stop ids)."""
MAX_TOKENIZER_BYTES = 64 << 20
"""Largest tokenizer.json read (the biggest vocabularies in use are a few tens of MiB)."""
MAX_JSON_BYTES = 4 << 20
"""Largest config, generation config or tokenizer config read."""
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""The chat template of a folder that has none: one ``role: content`` paragraph per message."""


def _read(path: Path, limit: int) -> str:
    """`path`'s text, refusing a file larger than `limit` bytes (a folder is data)."""
    size = path.stat().st_size
    if size > limit:
        raise ConfigError(f"{path} is {size} bytes, more than the {limit} read from a model folder")
    return path.read_text(encoding="utf-8")


def _json(path: Path) -> dict[str, Any]:
    """`path`'s JSON object, {} when the file is absent; ConfigError naming it if malformed."""
    if not path.is_file():
        return {}
    try:
        doc = json.loads(_read(path, MAX_JSON_BYTES))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} holds a {type(doc).__name__}, expected a JSON object")
    return doc


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: object) -> list[int]:
    """An ``eos_token_id`` entry: one id or a list of them (anything else is ignored)."""
    items = value if isinstance(value, list) else [value]
    return [i for i in items if isinstance(i, int) and not isinstance(i, bool) and i >= 0]


def _template(folder: Path, tok_config: Mapping[str, Any]) -> str | None:
    """The folder's chat template: ``chat_template.jinja``, else the tokenizer config's."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return _read(jinja, MAX_JSON_BYTES)
    found = tok_config.get("chat_template")
    if isinstance(found, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        found = named.get("default")
    return found if isinstance(found, str) else None


def _compile(template: str, source: str) -> Any:
    """`template` compiled in Jinja's immutable sandbox with the helpers templates expect."""
    require("jinja2", "a chat template")
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: object, indent: int | None = None, **_: object) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise ConfigError(f"the chat template of {source} does not compile: {exc}") from None


@dataclass(frozen=True)
class TextModel:
    """A model folder's tokenizer, EOS ids and compiled chat template.

    Attributes:
        folder: Where it was read from.
        tokenizer: The `tokenizers.Tokenizer` of ``tokenizer.json``.
        eos_ids: Ids that end generation (at most MAX_STOP_IDS).
        special: The special tokens' texts a template may use (bos_token, eos_token, ...).
        has_template: Whether the folder has its own chat template (else FALLBACK_TEMPLATE).

    """

    folder: Path
    tokenizer: Any
    eos_ids: tuple[int, ...]
    special: Mapping[str, str]
    has_template: bool
    _template: Any

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer may produce (added tokens included)."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, special: bool = True) -> list[int]:
        """`text`'s ids; `special` adds what the tokenizer adds around a text (a BOS)."""
        if len(text) > MAX_TEXT_CHARS:
            raise ConfigError(f"a text of {len(text)} characters is over {MAX_TEXT_CHARS}")
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens (EOS, BOS) left out."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The chat as the model was trained to read it, ending where the assistant answers.

        Raises ConfigError for too many messages or when the template refuses the
        chat (its ``raise_exception``: a role order it does not accept).
        """
        from jinja2 import TemplateError

        if not 1 <= len(messages) <= MAX_MESSAGES:
            raise ConfigError(f"a chat holds 1 to {MAX_MESSAGES} messages, got {len(messages)}")
        chat = [{"role": m["role"], "content": m["content"]} for m in messages]
        try:
            text = self._template.render(messages=chat, add_generation_prompt=True, **self.special)
        except TemplateError as exc:
            raise ConfigError(f"the chat template refused these messages: {exc}") from None
        return str(text)

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The ids of the rendered chat; a template writes its own BOS, so none is added."""
        return self.encode(self.render_chat(messages), special=not self.has_template)

    def decoder(self) -> IncrementalDecoder:
        """A decoder of a growing sequence of generated ids into text pieces."""
        return IncrementalDecoder(self)


class IncrementalDecoder:
    """Text of generated ids as they come, emitting only text that is complete.

    A byte-level token may hold half of a UTF-8 character; its text ends in
    U+FFFD until the rest arrives, so a piece is emitted only once its text no
    longer ends so. Each step decodes from `_prefix` (a few tokens back), which
    keeps a tokenizer's word-boundary rules (a sentencepiece leading space) the
    same as decoding the whole sequence, at a constant cost per token.
    """

    def __init__(self, text: TextModel) -> None:
        self._text = text
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, ids: Iterable[int]) -> str:
        """Add generated `ids`; the new text that is complete (may be empty)."""
        self._ids.extend(ids)
        before = self._text.decode(self._ids[self._prefix : self._read])
        now = self._text.decode(self._ids[self._prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        """What is left at the end, incomplete characters shown as U+FFFD."""
        before = self._text.decode(self._ids[self._prefix : self._read])
        now = self._text.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return now[len(before) :]


def _eos_ids(folder: Path, tokenizer: Any, tok_config: Mapping[str, Any]) -> tuple[int, ...]:
    """EOS ids from every file that names one, in the order generation reads them."""
    found = [
        *_ids(_json(folder / "generation_config.json").get("eos_token_id")),
        *_ids(_json(folder / "config.json").get("eos_token_id")),
    ]
    eos = _token_text(tok_config.get("eos_token"))
    if eos is not None and tokenizer.token_to_id(eos) is not None:
        found.append(int(tokenizer.token_to_id(eos)))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    return tuple(i for i in dict.fromkeys(found) if i < vocab)[:MAX_STOP_IDS]


def load_text(folder: Path | str) -> TextModel:
    """The text side of model folder `folder`; ConfigError naming what is missing or wrong."""
    folder = Path(folder).expanduser()
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"{folder} has no tokenizer.json: a pretrained model's ids mean nothing without "
            "its tokenizer (save one with the model, e.g. tokenizer.save_pretrained(DIR))"
        )
    tokenizers = require("tokenizers", "a model's tokenizer")
    try:
        tokenizer = tokenizers.Tokenizer.from_str(_read(path, MAX_TOKENIZER_BYTES))
    except Exception as exc:  # the library's own error type is not exported
        raise ConfigError(f"{path} is not a tokenizer the tokenizers library reads: {exc}") from (
            None
        )
    tok_config = _json(folder / "tokenizer_config.json")
    special = {
        name: text
        for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        if (text := _token_text(tok_config.get(name))) is not None
    }
    template = _template(folder, tok_config)
    return TextModel(
        folder=folder,
        tokenizer=tokenizer,
        eos_ids=_eos_ids(folder, tokenizer, tok_config),
        special=special,
        has_template=template is not None,
        _template=_compile(template or FALLBACK_TEMPLATE, str(folder)),
    )
