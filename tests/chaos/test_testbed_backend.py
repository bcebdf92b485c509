"""The testbed backend's pure parts: its testbed (spares named as the schedule names joiners),
and that it is a chaos Backend supporting every event kind. The real thing runs in
`make chaos` (root); its faults are tested in tests/testbed/test_chaos_bed.py."""

from __future__ import annotations

from pathlib import Path

from services.testbed.spec import preset
from tests.bench import bench_adapt, bench_async, bench_elastic, bench_recovery
from tests.chaos.backend import KINDS, Backend
from tests.chaos.schedule import draw
from tests.chaos.testbed_backend import SUBNET, TestbedBackend, spec_for


def test_the_testbed_has_the_devices_then_spares_named_as_joiners():
    spec = spec_for(["d0", "d1", "d2"], spares=2)
    assert spec.names() == ["d0", "d1", "d2", "j1", "j2"]
    assert spec.subnet == SUBNET
    assert sum(d.cpu for d in spec.devices[:5]) <= 1.6  # five live devices fit the box's budget


def test_every_join_a_schedule_draws_names_a_spare():
    schedule = draw(28, 27, KINDS, initial_devices=3, need=2)
    joins = [e.new_device for e in schedule.events if e.kind == "join"]
    spec = spec_for(["d0", "d1", "d2"], spares=len(joins))
    assert set(joins) <= set(spec.names())


def test_it_is_a_backend_of_every_kind(tmp_path: Path):
    backend = TestbedBackend(tmp_path)
    assert isinstance(backend, Backend)
    assert backend.supports == frozenset(KINDS)
    assert backend.pids.__doc__


def test_its_subnet_is_no_bench_s():
    used = {m.SUBNET for m in (bench_adapt, bench_async, bench_elastic, bench_recovery)}
    used.add(preset("env-d").subnet)
    assert SUBNET not in used
