"""Small model folders for the gateway's tests: a tokenizer trained here, nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a served model answers questions about foxes and dogs",
    "héllo wörld, naïve café ☕ and 東京 are words too",
    "the user asks and the assistant answers",
] * 4
SPECIAL = ["<s>", "</s>", "<unk>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_level_tokenizer(vocab: int = 400) -> Tokenizer:
    """A GPT-2-style byte-level BPE with a BOS added around each text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def metaspace_tokenizer(vocab: int = 300) -> Tokenizer:
    """A sentencepiece-style tokenizer (word pieces marked by a leading space sign)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab + 256, special_tokens=SPECIAL + byte_tokens)
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


def write_folder(
    folder: Path,
    tok: Tokenizer | None = None,
    template: str | None = CHAT_TEMPLATE,
    config: dict[str, object] | None = None,
) -> Path:
    """A model folder's text files: tokenizer.json, tokenizer_config.json, config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = tok or byte_level_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    tok_config: dict[str, object] = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if template is not None:
        tok_config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder
