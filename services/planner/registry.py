"""Every planner by name: the one module that knows them all.

The planners import `base` for the `Planner` interface and its helpers; listing them
here rather than in `base` keeps the planner package free of import cycles, and
gives the registry one fixed order however the modules happen to be imported.
"""

from __future__ import annotations

from common.errors import ConfigError
from services.planner.asteroid import AsteroidPlanner
from services.planner.base import Planner
from services.planner.baselines import (
    DapplePlanner,
    DataParallelPlanner,
    GPipePlanner,
    HetPipePlanner,
    OptimalPlanner,
    PipeDreamPlanner,
)
from services.planner.duanwu import DuanWuPlanner

__all__ = ["PLANNERS", "get_planner"]

PLANNERS: dict[str, type[Planner]] = {
    cls.name: cls
    for cls in (
        AsteroidPlanner,
        DataParallelPlanner,
        GPipePlanner,
        PipeDreamPlanner,
        DapplePlanner,
        HetPipePlanner,
        OptimalPlanner,
        DuanWuPlanner,
    )
}


def get_planner(name: str) -> Planner:
    """A fresh planner called `name`; ConfigError naming the known ones otherwise."""
    try:
        return PLANNERS[name]()
    except KeyError:
        raise ConfigError(
            f"unknown planner {name!r}; known planners: {', '.join(sorted(PLANNERS))}"
        ) from None
