import pytest

from common.errors import AsteroidError
from common.lifecycle import ACTIVE, TERMINAL, advance


def test_the_happy_path_and_its_shortcuts():
    state = "submitted"
    for to in ("profiling", "planning", "running", "finished"):
        state = advance(state, to)
    assert state == "finished"
    assert advance("submitted", "running") == "running"  # a plan was given
    assert advance("submitted", "planning") == "planning"  # profiles were cached


@pytest.mark.parametrize("state", sorted(ACTIVE))
@pytest.mark.parametrize("end", ["failed", "cancelled"])
def test_every_active_state_can_fail_or_be_cancelled(state, end):
    assert advance(state, end) == end


@pytest.mark.parametrize("state", sorted(TERMINAL))
def test_nothing_leaves_a_terminal_state(state):
    for to in ("submitted", "profiling", "running", "finished", "failed", "cancelled"):
        with pytest.raises(AsteroidError, match=f"already {state}"):
            advance(state, to)


@pytest.mark.parametrize(
    ("state", "to"),
    [("running", "planning"), ("planning", "profiling"), ("profiling", "finished")],
)
def test_no_going_back_or_skipping_training(state, to):
    with pytest.raises(AsteroidError, match=f"a {state} job cannot become {to}"):
        advance(state, to)
