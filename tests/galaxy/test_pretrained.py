"""A model folder on disk gives the weights `transformers` holds in memory, slice by slice."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import ConfigError
from common.galaxy.config import TransformerConfig
from common.serving_messages import MAX_PROMPT_TOKENS
from services.lib.galaxy import pretrained, sources
from services.lib.galaxy.weights import from_transformers
from tests.galaxy import hf_folders

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Each folder kind with the model saved in it (kept in float32 for the comparison)."""
    root = tmp_path_factory.mktemp("folders")
    models = {
        "gpt2": (hf_folders.gpt2(), {}),
        "gpt2-sharded": (hf_folders.gpt2(seed=5), {"shard_kb": 8}),
        "bert": (hf_folders.bert(), {}),
        "bert-cls-sharded": (hf_folders.bert(classes=3), {"shard_kb": 8}),
    }
    models.update(
        {
            "llama": (hf_folders.llama(), {"shard_kb": 8}),
            "llama-tied": (hf_folders.llama(seed=4, kv_heads=1, tied=True), {}),
            "mistral": (hf_folders.llama(seed=6, model_type="mistral"), {}),
            "qwen2": (hf_folders.llama(seed=8, kv_heads=4, model_type="qwen2"), {}),
        }
    )
    out = {}
    for name, (model, kwargs) in models.items():
        out[name] = (hf_folders.save(model, root / name, **kwargs), model)
    bf16 = hf_folders.gpt2(seed=7).to(torch.bfloat16)
    out["gpt2-bf16"] = (hf_folders.save(bf16, root / "gpt2-bf16"), bf16.float())
    half = hf_folders.llama(seed=9).to(torch.float16)
    out["llama-f16"] = (hf_folders.save(half, root / "llama-f16"), half.float())
    return out


def _whole(config: TransformerConfig) -> tuple[range, range]:
    return range(config.heads), range(config.ffn)


ALL = [
    "gpt2",
    "gpt2-sharded",
    "bert",
    "bert-cls-sharded",
    "gpt2-bf16",
    "llama",
    "llama-tied",
    "mistral",
    "qwen2",
    "llama-f16",
]


@pytest.mark.parametrize("name", ALL)
def test_a_folder_gives_the_weights_of_the_model_saved_in_it(folders, name):
    folder, model = folders[name]
    want_config, want = from_transformers(model)
    config = pretrained.read_config(folder)
    assert config == want_config
    assert pretrained.read_shape(str(folder)).config() == config
    got = pretrained.load_shard(folder, config, *_whole(config))
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == torch.float32
        assert torch.equal(got[key], want[key]), key


def test_a_sharded_folder_is_an_index_and_several_files(folders):
    folder, _ = folders["bert-cls-sharded"]
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 2
    assert pretrained.read_config(folder).num_classes == 3


CUTS = [(range(2, 4), range(5, 40)), (range(0, 2), range(0, 1))]


@pytest.mark.parametrize("name", ["gpt2", "bert-cls-sharded", "gpt2-bf16", "llama", "qwen2"])
@pytest.mark.parametrize(("heads", "cols"), CUTS)
def test_a_shard_read_from_the_folder_is_the_cut_of_the_whole_weights(folders, name, heads, cols):
    folder, model = folders[name]
    config, whole = from_transformers(model)
    got = pretrained.load_shard(folder, config, heads, cols)
    want = sources.shard(whole, config, heads, cols)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert got["layers.1.q.weight"].shape == (len(heads) * config.head_dim, config.hidden)
    assert got["layers.0.down.weight"].shape == (config.hidden, len(cols))


class _Counting:
    """A safetensors file that counts the numbers each read takes, and refuses whole reads."""

    def __init__(self, handle, taken: list[int]) -> None:
        self.handle, self.taken = handle, taken

    def __getattr__(self, name: str):
        if name == "get_tensor":
            raise AssertionError("a whole tensor was read")
        return getattr(self.handle, name)

    def get_slice(self, name: str):
        stored, taken = self.handle.get_slice(name), self.taken

        class Slice:
            def __getattr__(self, attr: str):
                return getattr(stored, attr)

            def __getitem__(self, index):
                t = stored[index]
                taken.append(t.numel())
                return t

        return Slice()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_shard_reads_only_the_numbers_it_keeps(folders, monkeypatch, name):
    folder, _ = folders[name]
    config = pretrained.read_config(folder)
    taken: list[int] = []
    real = pretrained.safe_open

    @contextlib.contextmanager
    def counting(path, framework):
        with real(path, framework=framework) as handle:
            yield _Counting(handle, taken)

    monkeypatch.setattr(pretrained, "safe_open", counting)
    shard = pretrained.load_shard(folder, config, range(2, 4), range(7, 19))
    kept = sum(t.numel() for t in shard.values())
    whole = sum(t.numel() for t in from_transformers(folders[name][1])[1].values())
    assert sum(taken) == kept < whole


def test_the_planned_model_must_be_the_folders(folders):
    folder, _ = folders["gpt2"]
    config = pretrained.read_config(folder)
    other = TransformerConfig(**{**config.__dict__, "heads": 8, "ffn": 64})
    with pytest.raises(ConfigError, match=r"another model than planned: heads 4 \(planned 8\), "):
        pretrained.load_shard(folder, other, range(8), range(64))


def _copy(folder: Path, to: Path) -> Path:
    to.mkdir()
    for f in folder.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


def _edit_config(folder: Path, **changes: object) -> None:
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))


def test_a_folder_is_refused_when_it_is_not_one_or_has_no_config(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory on this device"):
        pretrained.read_config(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        pretrained.read_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        pretrained.read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        pretrained.read_config(tmp_path)


def test_pickle_weights_are_refused_with_how_to_convert_them(folders, tmp_path):
    folder = _copy(folders["gpt2"][0], tmp_path / "bin")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 not even read")
    config = pretrained.read_config(folder)
    with pytest.raises(ConfigError, match=r"only as pickle files \(pytorch_model.bin\).*conv"):
        pretrained.load_shard(folder, config, *_whole(config))
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(ConfigError, match=r"has neither model\.safetensors nor"):
        pretrained.load_shard(folder, config, *_whole(config))


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"model_type": "t5"}, r"model_type must be one of \['bert', 'gpt2'"),
        ({"model_type": None}, "model_type must be one of"),
        ({"n_embd": 32768, "n_head": 4}, "cannot serve.*hidden"),
        ({"n_layer": 100_000}, "cannot serve.*layers"),
        ({"n_head": 5}, "must be a multiple of heads"),
        ({"n_layer": "2"}, "'n_layer' must be an integer"),
        ({"n_layer": True}, "'n_layer' must be an integer"),
        ({"activation_function": "relu"}, "GPT-2 activation must be one of"),
        ({"tie_word_embeddings": False}, "must be tied"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scaled by 1/sqrt"),
        ({"architectures": ["GPT2ForSequenceClassification"]}, "are none of"),
        ({"trust_remote_code": True, "auto_map": {"AutoModel": "x.Y"}}, None),
    ],
)
def test_a_config_we_cannot_serve_is_refused_naming_the_field(folders, tmp_path, changes, error):
    folder = _copy(folders["gpt2"][0], tmp_path / "f")
    _edit_config(folder, **changes)
    if error is None:  # remote code is never run: such fields are ignored, not obeyed
        assert pretrained.read_config(folder) == pretrained.read_config(folders["gpt2"][0])
        return
    with pytest.raises(ConfigError, match=error):
        pretrained.read_config(folder)


def test_a_bert_variant_we_do_not_compute_is_refused(folders, tmp_path):
    folder = _copy(folders["bert"][0], tmp_path / "f")
    _edit_config(folder, position_embedding_type="relative_key")
    with pytest.raises(ConfigError, match="must be 'absolute'"):
        pretrained.read_config(folder)
    _edit_config(folder, position_embedding_type="absolute", hidden_act="relu")
    with pytest.raises(ConfigError, match="must be 'gelu'"):
        pretrained.read_config(folder)


def _rewrite(folder: Path, change: dict[str, torch.Tensor | None]) -> None:
    """Replace (or, with None, drop) tensors of a single-file folder."""
    tensors = load_file(folder / "model.safetensors")
    for name, value in change.items():
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"transformer.h.1.attn.c_attn.weight": torch.zeros(32, 64)}, r"shape \(32, 96\)"),
        ({"transformer.h.0.mlp.c_fc.bias": None}, "lacks tensor 'transformer.h.0.mlp.c_fc.bias'"),
        ({"transformer.wte.weight": torch.zeros(61, 32, dtype=torch.int32)}, "is I32; served"),
        ({"transformer.ln_f.bias": torch.zeros(32, dtype=torch.float64)}, "is F64; served"),
        ({"transformer.wte.weight": None, "transformer.wpe.weight": None}, "no tensor 'wte"),
    ],
)
def test_a_tensor_of_the_wrong_shape_or_dtype_or_missing_is_refused(
    folders, tmp_path, change, error
):
    folder = _copy(folders["gpt2"][0], tmp_path / "f")
    _rewrite(folder, change)
    config = pretrained.read_config(folder)
    with pytest.raises(ConfigError, match=error):
        pretrained.load_shard(folder, config, *_whole(config))


@pytest.mark.parametrize(
    "weight_map",
    [
        {"transformer.wte.weight": "../outside.safetensors"},
        {"transformer.wte.weight": "/etc/passwd"},
        {"transformer.wte.weight": "model.bin"},
        {"transformer.wte.weight": 3},
        {},
        [],
    ],
)
def test_an_index_naming_files_outside_the_folder_or_not_safetensors_is_refused(
    folders, tmp_path, weight_map
):
    folder = _copy(folders["gpt2"][0], tmp_path / "f")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = pretrained.read_config(folder)
    with pytest.raises(ConfigError, match=r"model\.safetensors\.index\.json"):
        pretrained.load_shard(folder, config, *_whole(config))


def test_an_index_naming_a_missing_file_or_tensor_is_refused(folders, tmp_path):
    folder = _copy(folders["bert-cls-sharded"][0], tmp_path / "f")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = "model-00009-of-00009.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = pretrained.read_config(folder)
    with pytest.raises(ConfigError, match=r"cannot read model-00009-of-00009\.safetensors"):
        pretrained.load_shard(folder, config, *_whole(config))
    other = sorted(set(index["weight_map"].values()) - {"model-00009-of-00009.safetensors"})[0]
    index["weight_map"][first] = other
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=f"does not hold '{first}'"):
        pretrained.load_shard(folder, config, *_whole(config))


def test_a_llama_shard_keeps_its_kv_groups_and_a_cut_group_is_refused(folders):
    folder, model = folders["llama"]
    config, whole = from_transformers(model)
    assert (config.heads, config.kv_heads, config.norm, config.positions) == (4, 2, "rms", "rope")
    shard = pretrained.load_shard(folder, config, range(2, 4), range(0, 48))
    d = config.head_dim
    assert torch.equal(shard["layers.0.k.weight"], whole["layers.0.k.weight"][d : 2 * d])
    assert torch.equal(shard["layers.1.v.weight"], whole["layers.1.v.weight"][d : 2 * d])
    assert torch.equal(shard["layers.1.gate.weight"], whole["layers.1.gate.weight"])
    assert torch.equal(shard["lm_head.weight"], whole["lm_head.weight"])
    with pytest.raises(ConfigError, match="cut a key/value group of 2 query heads"):
        pretrained.load_shard(folder, config, range(1, 3), range(0, 48))


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "scaling 'llama3'"),
        ({"rope_parameters": None, "rope_scaling": {"type": "linear"}}, "scaling 'linear'"),
        ({"hidden_act": "gelu"}, "activation must be 'silu'"),
        ({"head_dim": 16}, "head_dim 16 times 4 heads"),
        ({"num_key_value_heads": 3}, "multiple of kv_heads"),
        ({"pretraining_tp": 2}, "pretraining_tp must be 1"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "are none of"),
    ],
)
def test_a_llama_variant_we_do_not_compute_is_refused(folders, tmp_path, changes, error):
    folder = _copy(folders["llama-tied"][0], tmp_path / "f")
    _edit_config(folder, **changes)
    with pytest.raises(ConfigError, match=error):
        pretrained.read_config(folder)


def test_a_long_rope_context_is_served_up_to_the_longest_prompt(folders, tmp_path):
    folder = _copy(folders["llama-tied"][0], tmp_path / "f")
    _edit_config(folder, max_position_embeddings=131072, rope_parameters=None, rope_theta=5e5)
    config = pretrained.read_config(folder)
    assert (config.max_positions, config.rope_theta) == (MAX_PROMPT_TOKENS, 5e5)
    _edit_config(folder, model_type="mistral", architectures=[], sliding_window=16)
    assert pretrained.read_config(folder).max_positions == 16  # never past the window
