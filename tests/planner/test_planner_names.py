from common.planner_names import PLANNER_NAMES
from services.planner.registry import PLANNERS


def test_the_names_jobs_may_ask_for_are_exactly_the_registered_planners():
    assert set(PLANNERS) == PLANNER_NAMES
