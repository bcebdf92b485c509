"""`asteroid plan` from a cluster file a person writes: profile names, not Redis keys.

The shipped example plans as written with no Redis at all; `--list-profiles` shows
the names a device may give; a misspelt name is one line with a did-you-mean and
exit code 2; `here` measures this machine; a fingerprint the profiler stored in
Redis resolves for the model asked for.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from common.exit_codes import ExitCode
from common.ports import free_port
from common.store import Store
from common.zoo import ModelSpec
from services.cli import app
from services.cli.example_files import example_names, example_path
from services.cli.plan_profiles import estimated_profile
from services.profiler.cache import save


@pytest.fixture
def no_redis(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A Redis URL nothing listens on, and no local cluster to fall back to."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.setenv("ASTEROID_REDIS_URL", url)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return url


def _plan(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["plan", *args])
    return res.exit_code, res.output


def _cluster(tmp_path: Path, profiles: list[str]) -> Path:
    path = tmp_path / "c.yaml"
    devices = [
        {"name": f"d{i}", "profile": p, "memory_bytes": "2GiB"} for i, p in enumerate(profiles)
    ]
    path.write_text(yaml.safe_dump({"devices": devices, "bandwidth": "125MB/s"}))
    return path


def test_the_example_cluster_file_plans_as_is_without_redis(no_redis: str) -> None:
    assert "cluster.yaml" in example_names()
    with example_path("cluster.yaml") as path:
        rc, out = _plan("--cluster", str(path), "--global-batch", "64", "--microbatches", "4")
    assert rc == 0, out
    assert "asteroid plan: 64 samples, 4 micro-batches" in out
    assert "simulated round" in out and "nx-0" in out


def test_list_profiles_names_the_shipped_kinds_and_here(no_redis: str) -> None:
    rc, out = _plan("--list-profiles")
    assert rc == 0, out
    for name in ("jetson-nano", "jetson-tx2", "xavier-nx", "nano-l", "nano-m", "nano-s", "here"):
        assert name in out
    assert "not listed" in out  # says that stored profiles could not be read


def test_an_unknown_profile_is_one_line_with_did_you_mean(no_redis: str, tmp_path: Path) -> None:
    cluster = _cluster(tmp_path, ["xavier-nx", "jetson-nan0"])
    rc, out = _plan("--cluster", str(cluster), "--global-batch", "8", "--microbatches", "2")
    assert rc == ExitCode.CONFIG, out
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    assert "unknown profile 'jetson-nan0'" in lines[0]
    assert "did you mean 'jetson-nano'" in lines[0] and "here" in lines[0]


def test_missing_sizes_say_what_to_give(no_redis: str) -> None:
    rc, out = _plan("--global-batch", "8")
    assert rc == ExitCode.CONFIG and "--cluster" in out


def test_faster_kinds_take_more_samples(no_redis: str, tmp_path: Path) -> None:
    spec = ModelSpec(name="small_cnn")
    nx, nano = estimated_profile(spec, "xavier-nx"), estimated_profile(spec, "jetson-nano")
    ratio = nano.time(1, 16, "F") / nx.time(1, 16, "F")
    assert ratio == pytest.approx(1.69 / 0.472)
    assert nx.layers[1].activation_bytes > 0 and nx.input_bytes == 3 * 32 * 32 * 4


def test_here_measures_this_machine(no_redis: str, tmp_path: Path) -> None:
    cluster = _cluster(tmp_path, ["here", "nano-m"])
    rc, out = _plan(
        "--cluster", str(cluster), "--global-batch", "8", "--microbatches", "2", "--model", "mlp"
    )
    assert rc == 0, out
    assert "asteroid plan: 8 samples" in out


def test_a_fingerprint_stored_in_redis_resolves(
    redis_url: str, cluster_name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ASTEROID_REDIS_URL", redis_url)
    monkeypatch.setenv("ASTEROID_CLUSTER", cluster_name)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    stored = estimated_profile(ModelSpec(name="small_cnn"), "nano-l")
    store = Store(redis_url, cluster_name)
    try:
        save(store, stored.model_copy(update={"device": "box-1"}))
    finally:
        store.close()
    rc, out = _plan("--list-profiles")
    assert rc == 0 and "box-1" in out, out
    cluster = _cluster(tmp_path, ["box-1", "jetson-tx2"])
    rc, out = _plan("--cluster", str(cluster), "--global-batch", "16", "--microbatches", "2")
    assert rc == 0, out
    rc, out = _plan(
        "--cluster",
        str(_cluster(tmp_path, ["box-2"])),
        "--global-batch",
        "8",
        "--microbatches",
        "2",
    )
    assert rc == ExitCode.CONFIG and "did you mean 'box-1'" in out, out
