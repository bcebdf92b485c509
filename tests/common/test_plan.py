import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.errors import PlanError
from common.plan import Plan, routes, split_ranges


def plan(stages, batch=32, m=4):
    return Plan.model_validate({"global_batch": batch, "microbatches": m, "stages": stages})


HPP = [
    {"start": 0, "end": 3, "devices": [{"device": "a", "share": 5}, {"device": "b", "share": 3}]},
    {"start": 3, "end": 5, "devices": [{"device": "c"}]},
    {"start": 5, "end": 8, "devices": [{"device": "d"}, {"device": "e"}]},
]


@given(st.integers(1, 500), st.lists(st.integers(1, 20), min_size=1, max_size=6))
def test_split_ranges_cover_exactly(total, shares):
    spans = split_ranges(total, shares)
    assert spans[0][0] == 0 and spans[-1][1] == total
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    for (lo, hi), s in zip(spans, shares, strict=True):
        assert abs((hi - lo) - total * s / sum(shares)) < 1


def test_five_three_split():
    p = plan(HPP)
    assert p.ranges(0) == {"a": (0, 5), "b": (5, 8)}
    assert p.ranges(2) == {"d": (0, 4), "e": (4, 8)}
    assert [p.warmup(i) for i in range(3)] == [4, 3, 1]
    p.validate_for(8)


@given(
    st.lists(st.integers(1, 9), min_size=1, max_size=4),
    st.lists(st.integers(1, 9), min_size=1, max_size=4),
)
def test_routes_partition_samples(a, b):
    n = 40
    s = {f"s{i}": r for i, r in enumerate(split_ranges(n, a))}
    r = {f"r{i}": x for i, x in enumerate(split_ranges(n, b))}
    covered = []
    for route in routes(s, r):
        assert s[route.src][0] <= route.lo < route.hi <= s[route.src][1]
        assert r[route.dst][0] <= route.lo < route.hi <= r[route.dst][1]
        covered.extend(range(route.lo, route.hi))
    assert sorted(covered) == list(range(n))


@pytest.mark.parametrize(
    "stages,layers,match",
    [
        (HPP, 9, "model has 9"),
        ([{"start": 1, "end": 8, "devices": [{"device": "a"}]}], 8, "starting at 0"),
        (
            [
                {"start": 0, "end": 4, "devices": [{"device": "a"}]},
                {"start": 4, "end": 8, "devices": [{"device": "a"}]},
            ],
            8,
            "more than one place",
        ),
        (
            [
                {
                    "start": 0,
                    "end": 8,
                    "devices": [{"device": "a", "share": 1}, {"device": "b", "share": 100}],
                }
            ],
            8,
            "device a in stage 0 gets no sample",
        ),
        (
            [
                {"start": 0, "end": 4, "devices": [{"device": "a"}], "warmup": 1},
                {"start": 4, "end": 8, "devices": [{"device": "b"}], "warmup": 3},
            ],
            8,
            "deadlock",
        ),
    ],
)
def test_invalid_plans_name_the_problem(stages, layers, match):
    with pytest.raises(PlanError, match=match):
        plan(stages).validate_for(layers)


def test_batch_not_divisible():
    with pytest.raises(PlanError, match="not divisible"):
        plan(HPP, batch=30, m=4).validate_for(8)
