"""Which devices a `kill_stage` kills: never more than the schedule counted."""

from __future__ import annotations

from tests.chaos.backend import REMOVING
from tests.chaos.runner import Runner


class _Watch:
    """The plan's stages and backups, as the runner reads them from Redis."""

    def __init__(self, stages: list[list[str]], backups: dict[int, str | None]) -> None:
        self.stages, self.backups = stages, backups

    def plan_devices(self) -> list[list[str]]:
        return self.stages

    def backup(self, stage: int) -> str | None:
        return self.backups.get(stage)


def _runner(stages: list[list[str]], backups: dict[int, str | None]) -> Runner:
    runner = Runner.__new__(Runner)
    runner.watch = _Watch(stages, backups)  # type: ignore[assignment]
    return runner


def test_a_stage_too_large_with_its_backup_is_passed_over_for_one_that_fits() -> None:
    # stage 0 is three devices whose backup is d: four would die, the schedule counted two
    runner = _runner([["a", "b", "c"], ["d"]], {0: "d", 1: "a"})
    targets, note = runner._stage_with_backup(pick=0)
    assert targets == ["a", "d"] and note == ""
    assert len(targets) <= REMOVING["kill_stage"]


def test_the_picked_stage_is_taken_when_it_fits() -> None:
    runner = _runner([["a"], ["b"], ["c"]], {0: "b", 1: "c", 2: "a"})
    assert runner._stage_with_backup(pick=4) == (["b", "c"], "")


def test_when_no_stage_fits_only_as_many_as_counted_die_and_the_note_says_so() -> None:
    runner = _runner([["a", "b"], ["c", "d", "e"]], {0: "c", 1: None})
    targets, note = runner._stage_with_backup(pick=0)
    assert len(targets) == REMOVING["kill_stage"]
    assert "no stage with its backup" in note
