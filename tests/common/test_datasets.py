"""A person's own data: image folders, arrays, `datasets` folders, factories.

Each loader is checked against the samples computed the plain way from the files
a test writes, for the rows asked only, and each refusal names its path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.numpy import save_file

from common.datasets import open_split
from common.datasets.images import ImageFolder, Normalise
from common.errors import ConfigError, DataPathError
from common.job import ArraysData, CustomData, HfFolderData, ImageFolderData, JobSpec
from common.job_data import eval_size, open_data, train_size
from common.zoo import ModelSpec, build_model

MLP = ModelSpec(name="mlp", options={"hidden": 8, "depth": 1})
MODEL = build_model(MLP, 0)  # float32 (3, 32, 32) images, 10 classes
SHAPE = (3, 32, 32)


def write_images(root: Path, per_class: dict[str, int], size: tuple[int, int] = (12, 10)) -> None:
    """PNGs whose pixels are a function of (class, file), in one folder per class."""
    for c, (name, count) in enumerate(sorted(per_class.items())):
        (root / name).mkdir(parents=True)
        for i in range(count):
            pixels = np.arange(size[0] * size[1] * 3).reshape(size[1], size[0], 3) * (c + 3) + i
            Image.fromarray((pixels % 256).astype(np.uint8)).save(root / name / f"{i:03d}.png")


def plain_image(file: Path, mean: float = 0.5, std: float = 0.5) -> torch.Tensor:
    """One image the plain way: RGB, bilinear resize to 32x32, [0, 1], normalised."""
    img = Image.open(file).convert("RGB").resize((32, 32), Image.Resampling.BILINEAR)
    x = torch.tensor(np.asarray(img), dtype=torch.float32).permute(2, 0, 1) / 255
    return (x - mean) / std


def job(dataset: object) -> JobSpec:
    return JobSpec.model_validate({"model": MLP.model_dump(), "dataset": dataset, "seed": 3})


# --- image folders -----------------------------------------------------------


def test_image_folder_reads_the_images_of_its_rows(tmp_path: Path) -> None:
    write_images(tmp_path, {"cat": 5, "dog": 4, "emu": 3})
    spec = job({"kind": "image_folder", "path": str(tmp_path), "held_out_fraction": 0.25})
    assert train_size(spec) == 9 and eval_size(spec) == 3
    data = open_data(spec, MODEL)
    split = open_split(spec.dataset)  # type: ignore[arg-type]
    folder = split.train
    assert isinstance(folder, ImageFolder)
    x, y = data.train.batch(torch.tensor([0, 4, 8]))
    rows = [split.train_rows[i] for i in (0, 4, 8)]
    want = torch.stack([plain_image(folder.files[r]) for r in rows])
    assert torch.equal(x, want)
    assert y.tolist() == [["cat", "dog", "emu"].index(folder.files[r].parent.name) for r in rows]
    # held-out rows are disjoint from the training rows and cover the folder with them
    assert sorted(split.train_rows + split.held_rows) == list(range(12))


def test_image_folder_opens_only_the_files_a_batch_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_images(tmp_path, {"a": 6, "b": 6})
    opened: list[str] = []
    real = Image.open

    def watch(fp: object, *args: object, **kwargs: object) -> Image.Image:
        opened.append(Path(str(fp)).name)
        return real(fp, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Image, "open", watch)
    data = open_data(job({"kind": "image_folder", "path": str(tmp_path)}), MODEL)
    assert opened == []  # listing reads names only
    data.train_batch(0, 2)
    assert len(opened) == 2


def test_image_folder_held_out_folder_numbers_classes_by_training_names(tmp_path: Path) -> None:
    write_images(tmp_path / "train", {"a": 2, "b": 2, "c": 2})
    write_images(tmp_path / "test", {"c": 1})
    spec = job(
        {
            "kind": "image_folder",
            "path": str(tmp_path / "train"),
            "held_out": str(tmp_path / "test"),
        }
    )
    data = open_data(spec, MODEL)
    assert data.train_size == 6 and data.eval_size == 1
    assert data.eval_batch(0, 1)[1].tolist() == [2]


def test_one_channel_model_reads_grey(tmp_path: Path) -> None:
    write_images(tmp_path, {"a": 2, "b": 2})
    folder = ImageFolder(tmp_path, Normalise((0.0,), (1.0,)))
    from common.zoo import InputSpec

    grey = InputSpec(kind="image", shape=(1, 8, 8), dtype=torch.float32)
    x, _ = folder.read([0], grey)
    img = Image.open(folder.files[0]).convert("L").resize((8, 8), Image.Resampling.BILINEAR)
    assert torch.equal(x[0, 0], torch.tensor(np.asarray(img), dtype=torch.float32) / 255)


@pytest.mark.parametrize(
    ("layout", "reason"),
    [
        ("absent", "does not exist"),
        ("empty", "no class sub-folders"),
        ("no-images", "has no images"),
        ("corrupt", "cannot decode image"),
    ],
)
def test_image_folder_errors_name_the_path(tmp_path: Path, layout: str, reason: str) -> None:
    root = tmp_path / "data"
    if layout != "absent":
        root.mkdir()
    if layout == "no-images":
        (root / "a").mkdir()
        (root / "a" / "notes.txt").write_text("x")
    if layout == "corrupt":
        (root / "a").mkdir()
        (root / "a" / "0.png").write_bytes(b"not a png")
        (root / "a" / "1.png").write_bytes(b"not a png")
    spec = job({"kind": "image_folder", "path": str(root)})
    with pytest.raises(ConfigError, match=reason) as caught:
        open_data(spec, MODEL).train_batch(0, 1)
    assert str(root) in str(caught.value)
    if layout != "corrupt":  # the coordinator's check says one sentence, the log the reason
        with pytest.raises(DataPathError) as public:
            train_size(spec)
        assert str(public.value) == DataPathError.PUBLIC and reason in public.value.detail


def test_image_folder_refuses_more_classes_than_the_model(tmp_path: Path) -> None:
    write_images(tmp_path, {f"c{i:02d}": 2 for i in range(11)}, size=(2, 2))
    with pytest.raises(ConfigError, match="11 classes, the model only 10"):
        open_data(job({"kind": "image_folder", "path": str(tmp_path)}), MODEL)


def test_image_spec_fields_are_bounded() -> None:
    with pytest.raises(ValueError, match="held_out_fraction"):
        ImageFolderData(path=Path("x"), held_out_fraction=1.0)
    with pytest.raises(ValueError, match="std"):
        ImageFolderData(path=Path("x"), std=(0.0,))
    with pytest.raises(ValueError, match="mean"):
        ImageFolderData(path=Path("x"), mean=(0.1,) * 5)


# --- arrays ------------------------------------------------------------------


def arrays(n: int = 20, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    gen = np.random.default_rng(seed)
    return gen.standard_normal((n, *SHAPE)).astype(np.float32), gen.integers(0, 10, n)


@pytest.mark.parametrize("form", ["npz", "npy", "safetensors"])
def test_arrays_give_their_rows(tmp_path: Path, form: str) -> None:
    x, y = arrays()
    if form == "npz":
        path = tmp_path / "d.npz"
        np.savez(path, x=x, y=y)
    elif form == "npy":
        path = tmp_path / "d"
        path.mkdir()
        np.save(path / "x.npy", x)
        np.save(path / "y.npy", y)
    else:
        path = tmp_path / "d.safetensors"
        save_file({"x": x, "y": y}, str(path))
    spec = job({"kind": "arrays", "path": str(path), "held_out_fraction": 0.2, "split_seed": 5})
    assert train_size(spec) == 16 and eval_size(spec) == 4
    data = open_data(spec, MODEL)
    split = open_split(spec.dataset)  # type: ignore[arg-type]
    got_x, got_y = data.train.batch(torch.tensor([3, 0, 15]))
    rows = [split.train_rows[i] for i in (3, 0, 15)]
    assert torch.equal(got_x, torch.from_numpy(x[rows]))
    assert got_y.tolist() == y[rows].tolist()
    ex, _ = data.eval_batch(0, 4)
    assert torch.equal(ex, torch.from_numpy(x[split.held_rows]))


def test_npy_arrays_are_memory_mapped(tmp_path: Path) -> None:
    x, y = arrays()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    source = open_split(ArraysData(path=tmp_path)).train
    assert isinstance(source._x, np.memmap)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("arrays_of", "reason"),
    [
        ({"x": np.zeros((4, 3, 16, 16), np.float32), "y": np.zeros(4, np.int64)}, "shape"),
        ({"x": np.zeros((4, *SHAPE), np.int64), "y": np.zeros(4, np.int64)}, "is integer"),
        ({"x": np.zeros((4, *SHAPE), np.float32), "y": np.zeros(3, np.int64)}, "y has 3"),
        ({"x": np.zeros((4, *SHAPE), np.float32), "y": np.full(4, 10)}, "labels span"),
        ({"x": np.zeros((4, *SHAPE), np.float32), "y": np.zeros(4, np.float32)}, "1-D integers"),
        ({"x": np.zeros((4, *SHAPE), np.float32)}, "lacks x or y"),
    ],
)
def test_arrays_refused_with_their_path(
    tmp_path: Path, arrays_of: dict[str, np.ndarray], reason: str
) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays_of)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=reason) as caught:
        open_data(job({"kind": "arrays", "path": str(path)}), MODEL)
    assert str(path) in str(caught.value)


def test_arrays_path_that_is_neither(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("1,2")
    with pytest.raises(ConfigError, match=r"not a \.npz, a \.safetensors or a folder"):
        open_split(ArraysData(path=tmp_path / "d.csv"))
    with pytest.raises(ConfigError, match="does not exist"):
        open_split(ArraysData(path=tmp_path / "nothing.npz"))


def test_eval_size_beyond_the_held_out_part(tmp_path: Path) -> None:
    x, y = arrays()
    np.savez(tmp_path / "d.npz", x=x, y=y)
    with pytest.raises(ConfigError, match="eval_size: 9 exceeds the 2 held-out"):
        open_split(ArraysData(path=tmp_path / "d.npz", eval_size=9))


# --- Hugging Face datasets folders ------------------------------------------------


def test_hf_folder_with_images_and_splits(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    images = [Image.fromarray(np.full((6, 5, 3), 20 * i, np.uint8)) for i in range(8)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    train = datasets.Dataset.from_dict(
        {"image": images[:6], "label": [0, 1, 2, 0, 1, 2]}, features=features
    )
    test = datasets.Dataset.from_dict({"image": images[6:], "label": [1, 2]}, features=features)
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "hf"))
    spec = job({"kind": "hf_folder", "path": str(tmp_path / "hf"), "held_out_split": "test"})
    assert train_size(spec) == 6 and eval_size(spec) == 2
    data = open_data(spec, MODEL)
    x, y = data.train.batch(torch.tensor([4]))
    img = images[4].convert("RGB").resize((32, 32), Image.Resampling.BILINEAR)
    want = (torch.tensor(np.asarray(img), dtype=torch.float32).permute(2, 0, 1) / 255 - 0.5) / 0.5
    assert torch.equal(x[0], want) and y.tolist() == [1]
    assert data.eval_batch(0, 2)[1].tolist() == [1, 2]


def test_hf_folder_with_array_column(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    x, y = arrays(10)
    ds = datasets.Dataset.from_dict({"x": list(x), "target": y.tolist()})
    ds.save_to_disk(str(tmp_path / "hf"))
    spec = job(
        {
            "kind": "hf_folder",
            "path": str(tmp_path / "hf"),
            "x_column": "x",
            "label_column": "target",
        }
    )
    data = open_data(spec, MODEL)
    split = open_split(spec.dataset)  # type: ignore[arg-type]
    got_x, got_y = data.train.batch(torch.tensor([1, 2]))
    rows = [split.train_rows[1], split.train_rows[2]]
    assert torch.equal(got_x, torch.from_numpy(x[rows])) and got_y.tolist() == y[rows].tolist()


def test_hf_folder_errors(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"x": [[1.0]] * 4, "label": [0] * 4}).save_to_disk(
        str(tmp_path / "hf")
    )
    with pytest.raises(ConfigError, match="has no column 'image'"):
        open_split(HfFolderData(path=tmp_path / "hf"))
    with pytest.raises(ConfigError, match="not a DatasetDict"):
        open_split(HfFolderData(path=tmp_path / "hf", x_column="x", held_out_split="test"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match="not a folder written by save_to_disk") as caught:
        open_split(HfFolderData(path=tmp_path / "plain"))
    assert str(tmp_path / "plain") in str(caught.value)


# --- factories ---------------------------------------------------------------


def test_custom_factory_only_when_allow_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_data_mod.py").write_text(
        "import torch\n"
        "from common.datasets import data_factory\n"
        "CALLS = []\n"
        "class Squares:\n"
        "    def __len__(self): return 10\n"
        "    def __getitem__(self, i):\n"
        "        CALLS.append(i)\n"
        "        return torch.full((3, 32, 32), float(i)), i % 10\n"
        "@data_factory\n"
        "def make(): return Squares()\n"
        "def helper(): raise RuntimeError('never called')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = job({"kind": "custom", "factory": "my_data_mod:make", "held_out_fraction": 0.2})
    with pytest.raises(ConfigError, match="not in this service's model_modules"):
        train_size(spec)
    assert "my_data_mod" not in sys.modules  # refused before any import
    allowed = ["my_data_mod"]
    assert train_size(spec, allowed) == 8 and eval_size(spec, allowed) == 2
    data = open_data(spec, MODEL, allowed)
    module = sys.modules["my_data_mod"]
    module.CALLS.clear()
    split = open_split(spec.dataset, allowed)  # type: ignore[arg-type]
    x, y = data.train.batch(torch.tensor([5]))
    row = split.train_rows[5]
    calls = module.CALLS
    assert calls == [row]  # only the row asked for
    assert torch.equal(x[0], torch.full(SHAPE, float(row))) and y.tolist() == [row % 10]
    helper = job({"kind": "custom", "factory": "my_data_mod:helper"})
    with pytest.raises(ConfigError, match="not declared a dataset factory"):
        train_size(helper, allowed)
    monkeypatch.delitem(sys.modules, "my_data_mod")


def test_custom_factory_name_is_bounded() -> None:
    with pytest.raises(ValueError, match="factory"):
        CustomData(factory="os.system('x'):make")


def test_missing_pillow_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_images(tmp_path, {"a": 2, "b": 2})
    data = open_data(job({"kind": "image_folder", "path": str(tmp_path)}), MODEL)
    monkeypatch.setitem(sys.modules, "PIL.Image", None)  # an import of it now fails
    with pytest.raises(ConfigError, match=r"image_folder needs the 'data' extra: pip install"):
        data.train_batch(0, 1)


def test_corrupt_safetensors_arrays_name_the_path(tmp_path: Path) -> None:
    path = tmp_path / "d.safetensors"
    path.write_bytes(b"\x00" * 5)
    with pytest.raises(ConfigError, match="is not readable safetensors") as caught:
        open_split(ArraysData(path=path))
    assert str(path) in str(caught.value)
