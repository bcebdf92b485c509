from pathlib import Path

import numpy as np
import pytest
import torch

from common.cifar10 import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    RECORD_BYTES,
    Cifar10Images,
    check_model,
    find_folder,
)
from common.errors import ConfigError
from common.zoo import ModelSpec, build_model


def make_records(labels: list[int], first: int = 0) -> np.ndarray:
    """Records with the given labels and pixels that encode record, channel and position."""
    out = np.zeros((len(labels), RECORD_BYTES), dtype=np.uint8)
    out[:, 0] = labels
    pos = np.arange(1024)
    for i in range(len(labels)):
        for c in range(3):
            out[i, 1 + c * 1024 : 1 + (c + 1) * 1024] = (7 * (first + i) + 50 * c + pos) % 256
    return out


def write(path: Path, records: np.ndarray) -> Path:
    path.write_bytes(records.tobytes())
    return path


def expected_image(record: np.ndarray) -> torch.Tensor:
    """The normalised image of one record, computed per pixel in float64 then rounded once."""
    out = np.empty((3, 32, 32), dtype=np.float32)
    for c in range(3):
        plane = record[1 + c * 1024 : 1 + (c + 1) * 1024].reshape(32, 32)
        out[c] = (plane.astype(np.float64) / 255 - CIFAR10_MEAN[c]) / CIFAR10_STD[c]
    return torch.from_numpy(out)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    write(tmp_path / "data_batch_1.bin", make_records([3, 0, 9], first=0))
    write(tmp_path / "data_batch_2.bin", make_records([1, 7], first=3))
    write(tmp_path / "test_batch.bin", make_records([5, 2], first=100))
    return tmp_path


def test_batch_has_exact_normalised_pixels_in_record_order(folder: Path) -> None:
    found = find_folder(folder)
    data = Cifar10Images(found.train)
    records = np.concatenate([make_records([3, 0, 9], 0), make_records([1, 7], 3)])
    indices = torch.tensor([4, 0, 2, 0, 3], dtype=torch.int64)
    images, labels = data.batch(indices)
    assert images.dtype == torch.float32 and images.shape == (5, 3, 32, 32)
    assert labels.dtype == torch.int64
    assert labels.tolist() == [7, 3, 9, 3, 1]
    for row, i in enumerate(indices.tolist()):
        assert torch.equal(images[row], expected_image(records[i])), i
    assert torch.equal(data.labels(indices), labels)


def test_pixel_layout_is_channel_then_row_major(tmp_path: Path) -> None:
    record = np.zeros(RECORD_BYTES, dtype=np.uint8)
    record[1 + 1024 + 32 * 5 + 7] = 255  # green, row 5, column 7
    data = Cifar10Images([write(tmp_path / "x.bin", record[None])])
    image, _ = data.batch(torch.tensor([0], dtype=torch.int64))
    bright = (image[0] > image[0].amin(dim=(1, 2), keepdim=True)).nonzero().tolist()
    assert bright == [[1, 5, 7]]
    assert image[0, 1, 5, 7] == pytest.approx((1 - CIFAR10_MEAN[1]) / CIFAR10_STD[1])
    assert image[0, 0, 0, 0] == pytest.approx(-CIFAR10_MEAN[0] / CIFAR10_STD[0])


def test_folder_counts_records_and_sorts_training_files(folder: Path) -> None:
    write(folder / "data_batch_0.bin", make_records([4]))
    found = find_folder(folder)
    assert [p.name for p in found.train] == [
        "data_batch_0.bin",
        "data_batch_1.bin",
        "data_batch_2.bin",
    ]
    assert (found.test.name, found.train_records, found.test_records) == ("test_batch.bin", 6, 2)
    assert Cifar10Images(found.train).labels(torch.arange(6)).tolist() == [4, 3, 0, 9, 1, 7]


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"dataset\.path: folder .*absent does not exist"):
        find_folder(tmp_path / "absent")


def test_no_training_files(tmp_path: Path) -> None:
    write(tmp_path / "test_batch.bin", make_records([1]))
    with pytest.raises(ConfigError, match=r"dataset\.path: no data_batch_\*\.bin"):
        find_folder(tmp_path)


def test_no_test_file(tmp_path: Path) -> None:
    write(tmp_path / "data_batch_1.bin", make_records([1]))
    with pytest.raises(ConfigError, match=r"dataset\.path: .* has no test_batch\.bin"):
        find_folder(tmp_path)


@pytest.mark.parametrize("name", ["data_batch_2.bin", "test_batch.bin"])
def test_truncated_file_is_named_with_its_size(folder: Path, name: str) -> None:
    path = folder / name
    path.write_bytes(path.read_bytes()[:-10])
    size = path.stat().st_size
    with pytest.raises(
        ConfigError, match=rf"dataset\.path: .*{name} has {size} bytes, not a multiple of the 3073"
    ):
        find_folder(folder)


def test_empty_file(folder: Path) -> None:
    (folder / "test_batch.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"dataset\.path: .*test_batch\.bin is empty"):
        find_folder(folder)


def test_label_out_of_range_names_file_and_record(folder: Path) -> None:
    write(folder / "data_batch_2.bin", make_records([1, 10], first=3))
    found = find_folder(folder)  # sizes alone look fine
    with pytest.raises(
        ConfigError, match=r"dataset\.path: .*data_batch_2\.bin record 1 has label 10, expected 0-9"
    ):
        Cifar10Images(found.train)


@pytest.mark.parametrize(
    "indices",
    [
        torch.tensor([0, 5]),
        torch.tensor([-1]),
        torch.tensor([0.0]),
        torch.zeros(1, 1, dtype=torch.int64),
    ],
)
def test_bad_indices(folder: Path, indices: torch.Tensor) -> None:
    data = Cifar10Images(find_folder(folder).train)
    with pytest.raises(ConfigError, match="indices must"):
        data.batch(indices)
    with pytest.raises(ConfigError, match="indices must"):
        data.labels(indices)


def test_model_must_take_cifar_images_in_ten_classes() -> None:
    check_model(build_model(ModelSpec(name="mlp", options={"hidden": 8, "depth": 1}), 0))
    with pytest.raises(ConfigError, match=r"10 classes; the model wants .* in 5 classes"):
        check_model(build_model(ModelSpec(name="mlp", num_classes=5, options={"depth": 0}), 0))
    tokens = ModelSpec(
        name="bert_small", options={"hidden": 16, "layers": 1, "heads": 2, "ffn": 16}
    )
    with pytest.raises(
        ConfigError, match=r"the model wants tokens input of torch\.int64, shape \(64,\)"
    ):
        check_model(build_model(tokens, 0))
