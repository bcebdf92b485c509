import re
from pathlib import Path

import numpy as np
import pytest
import torch

from common.cifar10 import RECORD_BYTES, Cifar10Images
from common.data import dataset_for, split_indices
from common.errors import ConfigError, DataPathError
from common.job import Cifar10Data, JobSpec, SyntheticData
from common.job_data import JobData, eval_size, open_data, train_size
from common.zoo import InputSpec, ModelSpec, build_model

MLP = ModelSpec(name="mlp", options={"hidden": 8, "depth": 1})


class IndexData:
    """A dataset whose samples are their own indices, to watch the order JobData asks for."""

    input = InputSpec(kind="tokens", shape=(1,), dtype=torch.int64, vocab_size=1)
    num_classes = 1

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return indices.unsqueeze(1), indices

    def labels(self, indices: torch.Tensor) -> torch.Tensor:
        return indices


def index_data(n: int, seed: int, eval_size: int = 4) -> JobData:
    return JobData(IndexData(), IndexData(), n, eval_size, seed, synthetic=False)


def order(data: JobData, start: int, count: int) -> list[int]:
    return data.train_batch(start, count)[1].tolist()


def test_unbounded_synthetic_is_the_training_split() -> None:
    model = build_model(MLP, 0)
    job = JobSpec(model=MLP, seed=7)
    data = open_data(job, model)
    reference = dataset_for(model, 7)
    for start, count in ((0, 5), (123, 9)):
        x, y = data.train_batch(start, count)
        rx, ry = reference.batch(split_indices("train", start, count))
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_each_epoch_visits_every_sample_once_in_a_new_order() -> None:
    n = 10
    data = index_data(n, seed=3)
    epochs = [order(data, e * n, n) for e in range(4)]
    for visited in epochs:
        assert sorted(visited) == list(range(n))
    assert len({tuple(e) for e in epochs}) == len(epochs)


def test_order_is_deterministic_in_seed_and_independent_of_batching() -> None:
    n = 10
    whole = order(index_data(n, seed=3), 0, 3 * n)
    assert whole == order(index_data(n, seed=3), 0, 3 * n)
    assert whole != order(index_data(n, seed=4), 0, 3 * n)
    fresh = index_data(n, seed=3)  # batches of 7 straddle epoch boundaries
    pieces = [x for start in range(0, 3 * n, 7) for x in order(fresh, start, 7)]
    assert pieces[: 3 * n] == whole


def test_finite_synthetic_draws_a_permutation_of_its_samples() -> None:
    n = 12
    model = build_model(MLP, 0)
    data = open_data(JobSpec(model=MLP, dataset=SyntheticData(train_size=n)), model)
    images, labels = data.train_batch(n, n)  # the second epoch
    ref_images, ref_labels = dataset_for(model, 0).batch(split_indices("train", 0, n))
    same = (images.unsqueeze(1) == ref_images.unsqueeze(0)).flatten(2).all(-1)
    assert same.sum(1).tolist() == [1] * n and same.sum(0).tolist() == [1] * n
    assert torch.equal(labels, ref_labels[same.int().argmax(1)])


def test_eval_wraps_past_eval_size() -> None:
    model = build_model(MLP, 0)
    job = JobSpec(model=MLP, dataset=SyntheticData(eval_size=5))
    data = open_data(job, model)
    x, y = data.eval_batch(3, 4)
    idx = split_indices("eval", 0, 5)[torch.tensor([3, 4, 0, 1])]
    rx, ry = dataset_for(model, 0).batch(idx)
    assert torch.equal(x, rx) and torch.equal(y, ry)
    assert index_data(10, 0, eval_size=3).eval_batch(2, 5)[1].tolist() == [2, 0, 1, 2, 0]


def write_cifar(folder: Path, train: list[int], test: int) -> Path:
    """Random records with valid labels: `train` records per training file, `test` held out."""
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i + 1}.bin" for i in range(len(train))] + ["test_batch.bin"]
    for name, count in zip(names, [*train, test], strict=True):
        records = rng.integers(0, 256, (count, RECORD_BYTES), dtype=np.uint8)
        records[:, 0] %= 10
        (folder / name).write_bytes(records.tobytes())
    return folder


def test_cifar10_end_to_end(tmp_path: Path) -> None:
    folder = write_cifar(tmp_path, train=[4, 3], test=5)
    spec = ModelSpec(name="small_cnn")
    job = JobSpec(model=spec, dataset=Cifar10Data(path=folder), seed=2, epochs=2, global_batch=3)
    assert train_size(job) == 7
    assert job.total_rounds(train_size(job)) == 5
    model = build_model(spec, 0)
    data = open_data(job, model)
    assert (data.train_size, data.eval_size) == (7, 5)

    train = Cifar10Images(sorted(folder.glob("data_batch_*.bin")))
    x, y = data.train_batch(7, 7)  # the second epoch: every record once
    rx, ry = train.batch(torch.arange(7))
    same = (x.unsqueeze(1) == rx.unsqueeze(0)).flatten(2).all(-1)
    assert same.sum(1).tolist() == [1] * 7 and same.sum(0).tolist() == [1] * 7
    assert torch.equal(y, ry[same.int().argmax(1)])

    ex, ey = data.eval_batch(3, 4)
    held_out = Cifar10Images([folder / "test_batch.bin"])
    rex, rey = held_out.batch(torch.tensor([3, 4, 0, 1]))
    assert torch.equal(ex, rex) and torch.equal(ey, rey)

    with torch.no_grad():
        assert model.full()(x).shape == (7, 10)


def test_cifar10_eval_size(tmp_path: Path) -> None:
    folder = write_cifar(tmp_path, train=[2], test=5)
    model = build_model(MLP, 0)
    job = JobSpec(model=MLP, dataset=Cifar10Data(path=folder, eval_size=3))
    assert open_data(job, model).eval_size == 3
    too_many = JobSpec(model=MLP, dataset=Cifar10Data(path=folder, eval_size=6))
    with pytest.raises(ConfigError, match=r"dataset\.eval_size: 6 exceeds the 5 records"):
        open_data(too_many, model)
    with pytest.raises(DataPathError) as caught:
        train_size(too_many)
    assert "dataset.eval_size: 6 exceeds the 5 records" in caught.value.detail


def test_cifar10_refuses_a_model_of_other_classes(tmp_path: Path) -> None:
    folder = write_cifar(tmp_path, train=[2], test=1)
    spec = ModelSpec(name="small_cnn", num_classes=100, options={"width": 4})
    job = JobSpec(model=spec, dataset=Cifar10Data(path=folder))
    with pytest.raises(ConfigError, match=r"the model wants .* in 100 classes"):
        open_data(job, build_model(spec, 0))


def test_train_size() -> None:
    assert train_size(JobSpec(model=MLP)) is None
    assert train_size(JobSpec(model=MLP, dataset=SyntheticData(train_size=40))) == 40


def test_train_size_reports_a_bad_folder_in_its_detail_only(tmp_path: Path) -> None:
    job = JobSpec(model=MLP, dataset=Cifar10Data(path=tmp_path / "absent"))
    with pytest.raises(DataPathError) as absent:
        train_size(job)
    assert re.fullmatch(r"dataset\.path: folder .* does not exist", absent.value.detail)
    folder = write_cifar(tmp_path, train=[2], test=1)
    (folder / "data_batch_1.bin").write_bytes(b"\0" * 100)
    with pytest.raises(DataPathError) as malformed:
        train_size(JobSpec(model=MLP, dataset=Cifar10Data(path=folder)))
    assert "data_batch_1.bin has 100 bytes" in malformed.value.detail
    # what a submitter is told does not say which of the two it was
    assert str(absent.value) == str(malformed.value) == DataPathError.PUBLIC
    assert isinstance(absent.value, ConfigError)


def test_eval_size(tmp_path: Path) -> None:
    assert eval_size(JobSpec(model=MLP, dataset=SyntheticData(eval_size=9))) == 9
    folder = write_cifar(tmp_path, train=[2], test=5)
    assert eval_size(JobSpec(model=MLP, dataset=Cifar10Data(path=folder))) == 5
    assert eval_size(JobSpec(model=MLP, dataset=Cifar10Data(path=folder, eval_size=2))) == 2
    (folder / "test_batch.bin").unlink()
    with pytest.raises(DataPathError) as caught:
        eval_size(JobSpec(model=MLP, dataset=Cifar10Data(path=folder, eval_size=2)))
    assert "has no test_batch.bin" in caught.value.detail
