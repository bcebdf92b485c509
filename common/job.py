"""The training job: what to train, on which data, with which optimizer, for how long.

Validated strictly (unknown keys rejected) because a typo in a job file
should stop the job before any device does work. `check_job` adds the checks
that need more than the file itself (the model exists, the data folder is
there) so that a bad spec fails with one error naming its field and nothing
is started.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from common.errors import ConfigError
from common.ids import JOB_ID_PATTERN, JobId, check_job_id
from common.zoo import ModelSpec, parameter_count

__all__ = [
    "JOB_ID_PATTERN",
    "MAX_BATCH",
    "MAX_CLASSES",
    "MAX_HOMES",
    "MAX_PARAMETERS",
    "MAX_ROUNDS",
    "ArraysData",
    "Cifar10Data",
    "CustomData",
    "DataSpec",
    "DigitsData",
    "FederatedSpec",
    "HfFolderData",
    "ImageFolderData",
    "JobSpec",
    "OptimizerSpec",
    "ScheduleSpec",
    "SyntheticData",
    "UserData",
    "check_job_id",
    "learning_rate",
    "load_job",
]


MAX_CLASSES = 100_000
"""Largest ``model.num_classes``: beyond any real label set, far below what crashes a build."""

MAX_BATCH = 1 << 20
"""Largest ``global_batch`` (and so ``micro_batch``) a job may ask for."""

MAX_ROUNDS = 1 << 40
"""Largest ``rounds``; also bounds the seeds' and sizes' integers to sane magnitudes."""

MAX_HOMES = 1000
"""Most homes one federation holds (and so one histogram's senders)."""

MAX_PARAMETERS = 1 << 30
"""Most parameters a job's model may have: 4 GiB of float32 weights (16 GiB with their
gradients and Adam's moments), beyond what the edge devices of one home hold together,
and more than 40x the largest model in the zoo."""

_MAX_SAMPLES = 1 << 40
_MAX_EVAL = 1 << 24
_MAX_SEED = 2**63 - 1


class _Strict(BaseModel):
    # no inf or nan: an infinite epochs or lr is never meant, and inf crashes rounding
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class ScheduleSpec(_Strict):
    """How the learning rate changes over rounds (one round is one optimizer step)."""

    kind: Literal["constant", "step", "cosine"] = Field(
        "constant", description="constant; step (times gamma every step_rounds); cosine."
    )
    step_rounds: int = Field(30, ge=1, description="step: rounds between decays.")
    gamma: float = Field(0.1, gt=0, le=1, description="step: factor applied at each decay.")
    warmup_rounds: int = Field(0, ge=0, description="Rounds of linear warm-up from lr/10.")
    min_lr: float = Field(0.0, ge=0, description="cosine: learning rate at the last round.")


class OptimizerSpec(_Strict):
    """Optimizer and its hyper-parameters; applied once per round."""

    kind: Literal["sgd", "adam", "adamw"] = Field("sgd", description="sgd, adam or adamw.")
    lr: float = Field(0.05, gt=0, description="Base learning rate.")
    momentum: float = Field(0.9, ge=0, description="sgd: momentum.")
    weight_decay: float = Field(0.0, ge=0, description="L2 (sgd, adam) or decoupled (adamw).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="adam/adamw: betas.")
    schedule: ScheduleSpec = Field(ScheduleSpec(), description="Learning-rate schedule.")


class SyntheticData(_Strict):
    """Generated samples that fit the model's input; every sample is a function of its index."""

    kind: Literal["synthetic"] = "synthetic"
    train_size: int | None = Field(
        None,
        ge=1,
        le=_MAX_SAMPLES,
        description="Training samples (None: a fresh sample every time).",
    )
    eval_size: int = Field(
        512, ge=1, le=_MAX_EVAL, description="Held-out samples used by evaluation."
    )


class Cifar10Data(_Strict):
    """CIFAR-10 in its binary format: records of 1 label byte and 3072 pixel bytes."""

    kind: Literal["cifar10"] = "cifar10"
    path: Path = Field(
        description="Folder with data_batch_*.bin (training) and test_batch.bin (held out)."
    )
    eval_size: int | None = Field(
        None, ge=1, le=_MAX_EVAL, description="Held-out samples used by evaluation (None: all)."
    )


class DigitsData(_Strict):
    """scikit-learn's digits (real 8x8 images shipped inside the package, no download).

    A federated home trains on its Dirichlet share of the training part: every
    device of the home computes the same share from the same seeds, so no sample
    ever travels. Held out: the same seeded test part everywhere.
    """

    kind: Literal["digits"] = "digits"
    homes: int = Field(1, ge=1, le=MAX_HOMES, description="Homes the training part is split over.")
    home: int = Field(0, ge=0, le=MAX_HOMES, description="This home's share (0-based).")
    alpha: float = Field(
        1.0, gt=0, le=1e6, description="Dirichlet label skew across homes (small: more skewed)."
    )
    split_seed: int = Field(
        0, ge=0, le=_MAX_SEED, description="Seed of the test split and of the homes' shares."
    )
    min_size: int = Field(10, ge=1, le=1000, description="Fewest training samples of any home.")

    @field_validator("home")
    @classmethod
    def _one_of_the_homes(cls, v: int, info: ValidationInfo) -> int:
        homes = info.data.get("homes")
        if homes is not None and v >= homes:
            raise ValueError(f"home {v} is not one of the {homes} homes (0..{homes - 1})")
        return v


class _HeldOutSplit(_Strict):
    """How a person's own data is split: a second source, or a seeded fraction held out."""

    held_out_fraction: float = Field(
        0.1,
        gt=0,
        lt=1,
        description="Share of the samples held out for evaluation, drawn with split_seed, "
        "when no separate held-out data is named.",
    )
    split_seed: int = Field(
        0, ge=0, le=_MAX_SEED, description="Seed of the held-out draw (held_out_fraction)."
    )
    eval_size: int | None = Field(
        None, ge=1, le=_MAX_EVAL, description="Held-out samples used by evaluation (None: all)."
    )


class _Normalised(_HeldOutSplit):
    """Images decoded to [0, 1], then ``(value - mean) / std`` per channel."""

    mean: tuple[Annotated[float, Field(ge=-1e3, le=1e3)], ...] = Field(
        (0.5,),
        min_length=1,
        max_length=4,
        description="Per-channel mean subtracted from pixels in [0, 1] (one value: all channels).",
    )
    std: tuple[Annotated[float, Field(ge=1e-6, le=1e3)], ...] = Field(
        (0.5,),
        min_length=1,
        max_length=4,
        description="Per-channel standard deviation pixels are divided by (one value: all).",
    )


class ImageFolderData(_Normalised):
    """Images in one sub-folder per class; class i is the i-th folder name in sorted order.

    Decoded with Pillow (the ``data`` extra) only when a batch needs them, converted
    to RGB (or grey for a one-channel model), resized bilinearly to the model's
    height and width, scaled to [0, 1] and normalised with `mean` and `std`.
    """

    kind: Literal["image_folder"] = "image_folder"
    path: Path = Field(description="Folder of class folders (training samples).")
    held_out: Path | None = Field(
        None,
        description="Folder of class folders held out for evaluation (same class names); "
        "None: held_out_fraction of path.",
    )


class ArraysData(_HeldOutSplit):
    """Arrays ``x`` (one row per sample, the model's input shape) and ``y`` (int labels).

    A ``.npz`` file, a folder with ``x.npy`` and ``y.npy`` (memory-mapped) or a
    ``.safetensors`` file with tensors ``x`` and ``y`` (read row by row).
    """

    kind: Literal["arrays"] = "arrays"
    path: Path = Field(description="A .npz, a folder with x.npy and y.npy, or a .safetensors.")
    held_out: Path | None = Field(
        None, description="Held-out arrays of the same form; None: held_out_fraction of path."
    )


_COLUMN = r"^[A-Za-z0-9_.-]{1,64}$"


class HfFolderData(_Normalised):
    """A Hugging Face `datasets` folder written by ``save_to_disk`` (the ``data`` extra).

    Read with ``load_from_disk``, which memory-maps its Arrow files: only the rows
    of a batch are read. An image column is decoded like `ImageFolderData`; an
    array column must have the model's input shape.
    """

    kind: Literal["hf_folder"] = "hf_folder"
    path: Path = Field(description="Folder written by Dataset(Dict).save_to_disk.")
    x_column: str = Field("image", pattern=_COLUMN, description="Column of the inputs.")
    label_column: str = Field("label", pattern=_COLUMN, description="Column of int labels.")
    split: str = Field(
        "train", pattern=_COLUMN, description="Training split of a DatasetDict folder."
    )
    held_out_split: str | None = Field(
        None,
        pattern=_COLUMN,
        description="Held-out split of a DatasetDict folder; None: held_out_fraction of split.",
    )


_FACTORY = r"^[A-Za-z_][A-Za-z0-9_.]{0,199}:[A-Za-z_][A-Za-z0-9_]{0,99}$"


class CustomData(_HeldOutSplit):
    """A map-style dataset of ``(x, y)`` made by a ``package.module:factory``.

    The factory is declared with `common.datasets.data_factory` and its module must be
    in the reading service's ``model_modules`` setting (the allow-list of custom
    models): otherwise nothing is imported.
    """

    kind: Literal["custom"] = "custom"
    factory: str = Field(pattern=_FACTORY, description="package.module:factory of training data.")
    held_out_factory: str | None = Field(
        None,
        pattern=_FACTORY,
        description="package.module:factory of held-out data; None: held_out_fraction.",
    )


UserData = ImageFolderData | ArraysData | HfFolderData | CustomData
"""The kinds of data a person brings (`common.datasets` reads them)."""

DataSpec = Annotated[
    SyntheticData
    | Cifar10Data
    | DigitsData
    | ImageFolderData
    | ArraysData
    | HfFolderData
    | CustomData,
    Field(discriminator="kind"),
]


class FederatedSpec(_Strict):
    """One home of a federation: train `rounds` rounds, send the model, receive, repeat."""

    federation_id: str = Field(
        pattern=JOB_ID_PATTERN, description="The federation's name (its spec's federation_id)."
    )
    address: str = Field(
        pattern=r"^tcp://[^\s/]{1,250}$",
        description="The federation service's endpoint (tcp://host:port).",
    )
    home: int = Field(ge=0, le=MAX_HOMES, description="This home's id in the federation.")
    keys: Path | None = Field(
        None,
        description="The federation's key set holding this home's pair (workers/home-N): "
        "the link then runs over CURVE; None: plain TCP (loopback and tests).",
    )
    timeout_s: float = Field(
        600.0,
        gt=0,
        le=86_400,
        description="Longest wait for the federation's next model (its slowest group's round).",
    )


class JobSpec(_Strict):
    """One training job as the coordinator runs it."""

    job_id: JobId = Field(
        JobId("job"),
        pattern=JOB_ID_PATTERN,
        description="Name of the job; keys its state and weights (letters, digits, . _ -).",
    )
    model: ModelSpec = Field(description="Zoo name (or package.module:factory) and options.")
    dataset: DataSpec = Field(SyntheticData(), description="Where samples come from.")
    seed: int = Field(
        0, ge=0, le=_MAX_SEED, description="Seed of the initial weights and of the data order."
    )
    global_batch: int | None = Field(
        None,
        ge=1,
        le=MAX_BATCH,
        description="Samples per round (required unless the plan is a file).",
    )
    micro_batch: int | None = Field(
        None, ge=1, le=MAX_BATCH, description="Samples per micro-batch; must divide global_batch."
    )
    rounds: int | None = Field(
        None,
        ge=1,
        le=MAX_ROUNDS,
        description="Optimizer steps to run (give rounds or epochs; default 10).",
    )
    epochs: float | None = Field(
        None,
        gt=0,
        le=1e6,
        description="Passes over a finite training set (instead of rounds).",
    )
    init_from: Path | None = Field(
        None,
        description="A .safetensors file of the whole model's weights to start from "
        "instead of seeded random ones (names and shapes as the model's state dict; "
        "read on the coordinator, which writes them as the job's round-0 checkpoint).",
    )
    optimizer: OptimizerSpec = Field(OptimizerSpec(), description="Optimizer and schedule.")
    policy: Literal["1f1b", "gpipe"] = Field("1f1b", description="Pipeline schedule.")
    mode: Literal["sync", "async"] = Field(
        "sync",
        description="sync: each round one step of the whole batch (exact); async (FTPipeHD, "
        "PipeDream): every micro-batch is a mini-batch updated right after its backward, "
        "no flush inside a round (a window) nor between windows, weight stashing and "
        "vertical sync; a pipeline of single-device stages only.",
    )
    aggregate_every: int = Field(
        0,
        ge=0,
        le=MAX_ROUNDS,
        description="async: after every this many updates of a window, replace the weights "
        "by the mean of the last K_0 updated versions (FTPipeHD's weight aggregation; "
        "0: never).",
    )
    planner: str = Field("asteroid", description="Planner that makes the plan.")
    eval_every: int = Field(
        0,
        ge=0,
        le=MAX_ROUNDS,
        description="Rounds between held-out evaluations (0: only after the last).",
    )
    checkpoint_every: int = Field(
        0, ge=0, le=MAX_ROUNDS, description="Rounds between checkpoints (0: only the final one)."
    )
    keep_checkpoints: int = Field(
        3,
        ge=1,
        le=MAX_ROUNDS,
        description="Committed checkpoints kept in Redis: once a newer one is committed, "
        "older ones beyond this many are deleted (the newest, which recovery and resume "
        "load, always stays).",
    )
    min_workers: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Workers to wait for before planning (absent: the vetted workers present "
        "once no more join for a moment, at least one).",
    )
    recovery: Literal["lightweight", "heavy", "none"] = Field(
        "lightweight",
        description="When devices are lost: move the partition points on the survivors "
        "(lightweight), plan again from profiles (heavy), or fail the job (none).",
    )
    elastic: bool = Field(
        True,
        description="Take in a worker that registers while the job runs, at a round "
        "boundary (re-planned with the planner; not for a plan given by hand).",
    )
    adapt: bool = Field(
        True,
        description="Re-plan when measured device speeds drift from the plan's (a throttled "
        "device): the planner plans again with each device's measured slowdown, and the job "
        "moves if the gain pays for the migration (a plan given by hand: its partition points "
        "move); also re-measure the links when rounds communicate far longer than planned.",
    )
    federation: FederatedSpec | None = Field(
        None,
        description="Train as one home of a federation (asteroid-federation): `rounds` "
        "local rounds per federated round, from the model the federation sends.",
    )
    replicate_every: int = Field(
        1,
        ge=0,
        le=MAX_ROUNDS,
        description="Rounds between replicas of each single-device stage on its backup node "
        "(0: none; a lost stage then comes back from the last checkpoint).",
    )

    @field_validator("model")
    @classmethod
    def _bounded_model(cls, v: ModelSpec) -> ModelSpec:
        # ModelSpec is shared with the profiler; the bound that protects a service from
        # a job is the job's, so it is checked here, while the message is decoded,
        # before any layer is allocated: every option has a ceiling, and a zoo model's
        # size is counted from its options without building it.
        if not 1 <= v.num_classes <= MAX_CLASSES:
            raise ValueError(f"num_classes must be in [1, {MAX_CLASSES}], got {v.num_classes}")
        try:
            count = parameter_count(v)
        except ConfigError as exc:
            raise ValueError(str(exc)) from exc
        if count is not None and count > MAX_PARAMETERS:
            raise ValueError(
                f"model {v.name!r} would have {count} parameters "
                f"({count * 4 / 2**30:.1f} GiB as float32); at most {MAX_PARAMETERS} "
                f"({MAX_PARAMETERS * 4 / 2**30:g} GiB) are allowed"
            )
        return v

    @field_validator("aggregate_every")
    @classmethod
    def _async_only(cls, v: int, info: ValidationInfo) -> int:
        if v and info.data.get("mode") != "async":
            raise ValueError("aggregate_every is for mode: async")
        if info.data.get("mode") == "async" and info.data.get("policy", "1f1b") != "1f1b":
            raise ValueError("mode: async runs 1F1B (policy: 1f1b)")
        return v

    @field_validator("micro_batch")
    @classmethod
    def _divides(cls, v: int | None, info: ValidationInfo) -> int | None:
        gb = info.data.get("global_batch")
        if v is not None and gb is None:
            raise ValueError("micro_batch needs global_batch")
        if v is not None and gb is not None and gb % v:
            raise ValueError(f"global_batch {gb} is not a multiple of micro_batch {v}")
        return v

    @field_validator("epochs")
    @classmethod
    def _finite(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v is None:
            return v
        if info.data.get("rounds") is not None:
            raise ValueError("give rounds or epochs, not both")
        if info.data.get("global_batch") is None:
            raise ValueError("epochs need global_batch")
        data = info.data.get("dataset")
        if isinstance(data, SyntheticData) and data.train_size is None:
            raise ValueError("epochs need a finite dataset (set dataset.train_size)")
        return v

    @property
    def microbatches(self) -> int | None:
        """Micro-batches per round, when the spec fixes the geometry."""
        if self.global_batch is None:
            return None
        return self.global_batch // (self.micro_batch or self.global_batch)

    def total_rounds(self, train_size: int | None = None) -> int:
        """Rounds to run: `rounds`, or `epochs` over `train_size` samples (rounded up)."""
        if self.epochs is None:
            return self.rounds or 10
        size = train_size
        if size is None and isinstance(self.dataset, SyntheticData):
            size = self.dataset.train_size
        if size is None or self.global_batch is None:
            raise ConfigError("epochs need the training set's size and global_batch")
        return max(1, math.ceil(self.epochs * size / self.global_batch))


def learning_rate(spec: OptimizerSpec, round_no: int, total_rounds: int) -> float:
    """The learning rate of round `round_no` (0-based) of `total_rounds`.

    A pure function of the round so that every worker, a resumed job and the
    single-process reference agree without exchanging scheduler state.
    """
    sched, base = spec.schedule, spec.lr
    if round_no < sched.warmup_rounds:
        return base * (0.1 + 0.9 * round_no / sched.warmup_rounds)
    if sched.kind == "step":
        return base * sched.gamma ** ((round_no - sched.warmup_rounds) // sched.step_rounds)
    if sched.kind == "cosine":
        span = max(1, total_rounds - sched.warmup_rounds - 1)
        t = min(1.0, (round_no - sched.warmup_rounds) / span)
        return sched.min_lr + (base - sched.min_lr) * 0.5 * (1 + math.cos(math.pi * t))
    return base


def load_job(path: Path) -> JobSpec:
    """Read a job spec from YAML or JSON, with an error that names the file and field."""
    from common.spec_files import load_spec_file  # it imports this module's errors only

    return load_spec_file(path, JobSpec, "job")
