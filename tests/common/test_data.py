import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.data import (
    EVAL_OFFSET,
    SPLIT_SIZE,
    TRAIN_OFFSET,
    SyntheticImages,
    SyntheticTokens,
    _mix32,
    dataset_for,
    split_indices,
)
from common.errors import ConfigError
from common.zoo import ModelSpec, build_model

ROOT = Path(__file__).resolve().parents[2]
IMAGES = SyntheticImages(seed=11)
TOKENS = SyntheticTokens(seed=11)
DATASETS = {"images": IMAGES, "tokens": TOKENS}


def lowbias32_reference(x: int) -> int:
    """The published hash on Python integers, to check the int64-tensor version."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_matches_plain_integer_reference() -> None:
    values = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]
    values += [(i * 0x9E3779B9) & 0xFFFFFFFF for i in range(1000)]
    got = _mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [lowbias32_reference(v) for v in values]


@pytest.mark.parametrize("kind", sorted(DATASETS))
def test_batches_are_deterministic(kind: str) -> None:
    indices = torch.tensor([5, 0, 2**62, 7, 5], dtype=torch.int64)
    x1, y1 = DATASETS[kind].batch(indices)
    fresh = SyntheticImages(seed=11) if kind == "images" else SyntheticTokens(seed=11)
    x2, y2 = fresh.batch(indices)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[0], x1[4])  # the same index is the same sample
    other = SyntheticImages(seed=12) if kind == "images" else SyntheticTokens(seed=12)
    x3, _ = other.batch(indices)
    assert not torch.equal(x1, x3)


@settings(max_examples=40, deadline=None, database=None)
@given(
    kind=st.sampled_from(sorted(DATASETS)),
    start=st.integers(min_value=0, max_value=2**45),
    cuts=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=4),
)
def test_batch_of_a_range_is_the_concatenation_of_its_sub_ranges(
    kind: str, start: int, cuts: list[int]
) -> None:
    dataset = DATASETS[kind]
    stop = start + sum(cuts)
    whole_x, whole_y = dataset.batch(torch.arange(start, stop, dtype=torch.int64))
    parts = []
    lo = start
    for size in cuts:
        parts.append(dataset.batch(torch.arange(lo, lo + size, dtype=torch.int64)))
        lo += size
    assert torch.equal(whole_x, torch.cat([x for x, _ in parts]))
    assert torch.equal(whole_y, torch.cat([y for _, y in parts]))


@settings(max_examples=20, deadline=None, database=None)
@given(indices=st.lists(st.integers(min_value=0, max_value=2**63 - 1), min_size=1, max_size=8))
def test_each_sample_depends_only_on_its_index(indices: list[int]) -> None:
    batch_x, batch_y = IMAGES.batch(torch.tensor(indices, dtype=torch.int64))
    for row, index in enumerate(indices):
        x, y = IMAGES.batch(torch.tensor([index], dtype=torch.int64))
        assert torch.equal(batch_x[row], x[0]) and torch.equal(batch_y[row], y[0])


def test_image_batches_have_the_advertised_shape_and_scale() -> None:
    x, y = IMAGES.batch(split_indices("train", 0, 256))
    assert x.shape == (256, 3, 32, 32) and x.dtype == torch.float32
    assert y.shape == (256,) and y.dtype == torch.int64
    assert IMAGES.input.shape == (3, 32, 32)
    assert abs(float(x.mean())) < 0.1
    assert 0.8 < float(x.std()) < 1.2


def test_token_batches_have_the_advertised_shape_and_range() -> None:
    x, y = TOKENS.batch(split_indices("train", 0, 256))
    assert x.shape == (256, 64) and x.dtype == torch.int64
    assert y.dtype == torch.int64
    assert (x[:, 0] == 0).all()  # [CLS]
    assert int(x[:, 1:].min()) >= 1 and int(x.max()) < 1000


def test_tokens_carry_the_class() -> None:
    x, y = TOKENS.batch(split_indices("train", 0, 2000))
    counts = torch.zeros(10, 1000)
    for label in range(10):
        counts[label] = torch.bincount(x[y == label, 1:].flatten(), minlength=1000).float()
    top = counts.argmax(dim=1)
    assert len(set(top.tolist())) == 10  # each class has its own most frequent token


@pytest.mark.parametrize("kind", sorted(DATASETS))
def test_labels_are_in_range_and_roughly_balanced(kind: str) -> None:
    y = DATASETS[kind].labels(split_indices("train", 0, 20_000))
    assert y.dtype == torch.int64
    assert int(y.min()) >= 0 and int(y.max()) < 10
    counts = torch.bincount(y, minlength=10)
    assert int(counts.min()) > 1800 and int(counts.max()) < 2200


@pytest.mark.parametrize("kind", sorted(DATASETS))
def test_labels_agree_with_batches(kind: str) -> None:
    indices = split_indices("eval", 100, 50)
    assert torch.equal(DATASETS[kind].labels(indices), DATASETS[kind].batch(indices)[1])


def test_labels_respect_num_classes() -> None:
    _, y = SyntheticImages(seed=0, num_classes=3, shape=(1, 4, 4)).batch(
        split_indices("eval", 0, 300)
    )
    assert set(y.tolist()) == {0, 1, 2}


def test_train_and_eval_splits_are_disjoint() -> None:
    train = split_indices("train", 0, 100)
    held_out = split_indices("eval", 0, 100)
    assert int(train[0]) == TRAIN_OFFSET and int(held_out[0]) == EVAL_OFFSET
    assert TRAIN_OFFSET + SPLIT_SIZE <= EVAL_OFFSET
    assert not set(train.tolist()) & set(held_out.tolist())
    assert not torch.equal(IMAGES.batch(train)[0], IMAGES.batch(held_out)[0])


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("test", 0, 1), "split must be"),
        (("train", -1, 1), "outside"),
        (("eval", SPLIT_SIZE - 1, 2), "outside"),
    ],
)
def test_bad_split_ranges_raise(args: tuple[str, int, int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        split_indices(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("indices", "match"),
    [
        (torch.tensor([0.0, 1.0]), "int64"),
        (torch.tensor([[0, 1]]), "1-D"),
        (torch.tensor([3, -1]), ">= 0"),
    ],
)
def test_bad_indices_raise(indices: torch.Tensor, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        IMAGES.batch(indices)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: SyntheticImages(seed=-1), "seed"),
        (lambda: SyntheticImages(seed=0, num_classes=0), "num_classes"),
        (lambda: SyntheticImages(seed=0, noise=-1.0), "noise"),
        (lambda: SyntheticTokens(seed=0, seq_len=1), "seq_len"),
        (lambda: SyntheticTokens(seed=0, vocab_size=1), "vocab_size"),
        (lambda: SyntheticTokens(seed=0, signal=1.5), "signal"),
    ],
)
def test_bad_dataset_arguments_raise(make: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()  # type: ignore[operator]


def test_empty_batch() -> None:
    x, y = IMAGES.batch(torch.empty(0, dtype=torch.int64))
    assert x.shape == (0, 3, 32, 32) and y.shape == (0,)


def test_dataset_for_matches_the_model_input() -> None:
    images = dataset_for(build_model(ModelSpec(name="mlp", num_classes=4), seed=0), seed=1)
    assert isinstance(images, SyntheticImages) and images.num_classes == 4
    bert = build_model(
        ModelSpec(
            name="bert_small",
            options={"seq_len": 16, "vocab_size": 40, "hidden": 32, "layers": 1, "heads": 2},
        ),
        seed=0,
    )
    tokens = dataset_for(bert, seed=1)
    assert isinstance(tokens, SyntheticTokens)
    x, _ = tokens.batch(split_indices("train", 0, 2))
    assert x.shape == (2, 16) and int(x.max()) < 40
    assert bert.full()(x).shape == (2, 10)


def data_sha256(seed: int) -> str:
    """Self-contained (its source also runs in a child process)."""
    import hashlib

    import torch

    from common.data import SyntheticImages, SyntheticTokens

    digest = hashlib.sha256()
    indices = torch.arange(2**40 - 5, 2**40 + 5, dtype=torch.int64)
    for dataset in (SyntheticImages(seed), SyntheticTokens(seed)):
        for tensor in dataset.batch(indices):
            digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def test_data_is_identical_in_a_fresh_process() -> None:
    script = "\n".join(
        [
            "import torch",
            "torch.set_num_threads(2)",
            inspect.getsource(data_sha256),
            "print(data_sha256(99))",
        ]
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    child = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=env,
    )
    assert child.stdout.strip() == data_sha256(99)


def test_mlp_learns_synthetic_images() -> None:
    model = build_model(ModelSpec(name="mlp"), seed=0)
    net = model.full()
    data = dataset_for(model, seed=3)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    eval_x, eval_y = data.batch(split_indices("eval", 0, 500))

    def accuracy() -> float:
        with torch.no_grad():
            return float((net(eval_x).argmax(dim=1) == eval_y).float().mean())

    before = accuracy()
    for step in range(150):
        x, y = data.batch(split_indices("train", 32 * step, 32))
        loss = torch.nn.functional.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = accuracy()
    assert before < 0.25  # chance is 0.1
    assert after > 0.6
