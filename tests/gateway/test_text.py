"""A model folder's tokenizer, EOS ids and chat template, against the libraries used plainly."""

from __future__ import annotations

import json

import pytest
from jinja2 import Template

from common.errors import ConfigError
from services.lib.text import FALLBACK_TEMPLATE, MAX_MESSAGES, load_text
from tests.gateway.folders import (
    CHAT_TEMPLATE,
    SENTENCES,
    byte_level_tokenizer,
    metaspace_tokenizer,
    write_folder,
)

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what does the fox do?"},
]


def test_text_round_trips_through_the_folder_tokenizer(tmp_path):
    tok = byte_level_tokenizer()
    text = load_text(write_folder(tmp_path, tok))
    ids = text.encode(SENTENCES[2])
    assert ids == tok.encode(SENTENCES[2]).ids
    assert ids[0] == tok.token_to_id("<s>")  # the post-processor's BOS
    assert text.decode(ids) == SENTENCES[2]  # the BOS is left out of the text
    assert text.encode("fox", special=False) == tok.encode("fox", add_special_tokens=False).ids


def test_eos_ids_come_from_every_file_once(tmp_path):
    tok = byte_level_tokenizer()
    eos = tok.token_to_id("</s>")
    folder = write_folder(tmp_path, tok, config={"eos_token_id": [eos, 7, 10**9]})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_text(folder).eos_ids == (5, eos, 7)  # out-of-vocabulary ids dropped


def test_the_chat_template_renders_as_jinja_renders_it(tmp_path):
    text = load_text(write_folder(tmp_path))
    want = Template(CHAT_TEMPLATE).render(
        messages=CHAT, add_generation_prompt=True, bos_token="<s>", eos_token="</s>"
    )
    assert text.render_chat(CHAT) == want
    assert want.endswith("<|assistant|>")
    ids = text.encode_chat(CHAT)
    assert ids == text.tokenizer.encode(want, add_special_tokens=False).ids  # BOS once


def test_a_template_file_wins_and_a_folder_without_one_gets_the_plain_template(tmp_path):
    folder = write_folder(tmp_path / "a")
    (folder / "chat_template.jinja").write_text("{{ messages[-1]['content'] }}!")
    assert load_text(folder).render_chat(CHAT) == "what does the fox do?!"
    bare = load_text(write_folder(tmp_path / "b", template=None))
    assert not bare.has_template
    assert bare.render_chat(CHAT) == Template(FALLBACK_TEMPLATE).render(
        messages=CHAT, add_generation_prompt=True
    )
    assert bare.render_chat(CHAT).endswith("assistant:")


def test_the_template_refuses_through_raise_exception_and_bounds_hold(tmp_path):
    text = load_text(write_folder(tmp_path))
    with pytest.raises(ConfigError, match="unknown role tool"):
        text.render_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(ConfigError, match="1 to 256 messages"):
        text.render_chat([{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1))
    with pytest.raises(ConfigError, match="1 to 256 messages"):
        text.render_chat([])


def test_the_sandbox_keeps_a_template_and_messages_away_from_python(tmp_path):
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    text = load_text(write_folder(tmp_path, template=evil))
    with pytest.raises(ConfigError, match="refused"):
        text.render_chat(CHAT)
    sneaky = [{"role": "user", "content": "{{ 7 * 7 }}"}]  # a message is data, not template
    assert "{{ 7 * 7 }}" in load_text(write_folder(tmp_path / "b")).render_chat(sneaky)


def test_a_folder_without_a_tokenizer_is_refused_not_read_as_bytes(tmp_path):
    with pytest.raises(ConfigError, match=r"no tokenizer\.json"):
        load_text(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizers library"):
        load_text(tmp_path)
    write_folder(tmp_path / "c")
    (tmp_path / "c" / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        load_text(tmp_path / "c")
    write_folder(tmp_path / "d", template="{% for %}")
    with pytest.raises(ConfigError, match="does not compile"):
        load_text(tmp_path / "d")


@pytest.mark.parametrize("make", [byte_level_tokenizer, metaspace_tokenizer])
@pytest.mark.parametrize("sentence", [SENTENCES[0], SENTENCES[2], "☕東京 naïve"])
def test_incremental_pieces_join_to_the_whole_decode(tmp_path, make, sentence):
    text = load_text(write_folder(tmp_path, make()))
    ids = text.encode(sentence, special=False)
    decoder = text.decoder()
    pieces = [decoder.push([i]) for i in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == text.decode(ids) == sentence
    assert not any("\ufffd" in p for p in pieces)  # a half character is never emitted


def test_a_cut_character_waits_for_its_other_bytes_and_shows_at_the_end(tmp_path):
    tok = byte_level_tokenizer()
    text = load_text(write_folder(tmp_path, tok))
    # the byte tokens of "☕" (three UTF-8 bytes), one at a time
    byte_ids = [tok.token_to_id(ch) for ch in _byte_symbols("☕".encode())]
    decoder = text.decoder()
    assert decoder.push(byte_ids[:1]) == ""
    assert decoder.push(byte_ids[1:2]) == ""
    assert decoder.push(byte_ids[2:]) == "☕"
    assert decoder.push(byte_ids[:1]) == ""
    assert decoder.flush() == "\ufffd"  # generation ended inside a character


def _byte_symbols(data: bytes) -> list[str]:
    """GPT-2's printable symbol of each byte (the byte-level alphabet's own mapping)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in data]
