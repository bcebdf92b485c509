"""Where Eco-FL cannot hold its groups: the homes no band holds after the first round.

Algorithm 1 drops a home that no group's band holds; with homes spread evenly over a
wide range (no clusters narrower than the band) that happens right after the groups
are formed, and the federation says so, naming the homes, the band and the band that
would hold them. FedAsync and FedAT drop nobody, so they get no warning.
"""

from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from typer.testing import CliRunner

from common.errors import ConfigError
from common.fl.spec import load_federation
from common.settings import FederationSettings
from services.cli import app
from services.federation.band import Unheld, unheld_homes
from services.federation.grouping import GroupState, regroup
from services.federation.service import FederationService
from services.federation.strategies import make_strategy
from tests.fl.test_server import A, federation, groups_of, run_round

ROOT = Path(__file__).resolve().parents[2]
SPREAD = (1.2, 0.45, 0.9, 2.0, 2.9)
"""Five homes spread evenly over 6x (round times measured on the testbed)."""
CLUSTERED = (1.0, 1.1, 0.9, 4.0, 4.4)
"""Two clusters of similar homes, each narrower than the band, 4x apart."""


def test_a_spread_fast_tier_leaves_two_homes_unheld_and_names_the_band_that_holds_them() -> None:
    # Group (0, 1, 2) at 1.2, 0.45, 0.9 s: home 0 against the others' mean 0.675 is off
    # by 0.525 > 0.5 * 0.675, and the slow group's band (2.45 +- 1.225) misses 1.2 too;
    # home 1 against 1.05 is off by 0.6 > 0.525; home 2 (0.075 off 0.825) stays.
    # Largest relative gap: home 0's 0.525 / 0.675 = 7/9.
    found = unheld_homes(((0, 1, 2), (3, 4)), SPREAD, 0.5)
    assert found is not None
    assert found.homes == ((0, 1.2), (1, 0.45))
    assert found.rt_fraction == 0.5
    assert found.needed == pytest.approx(7 / 9)
    assert unheld_homes(((0, 1, 2), (3, 4)), SPREAD, found.needed) is None
    text = found.warning()
    for part in ("home 0 (1.2 s)", "home 1 (0.45 s)", "rt_fraction 0.5", "0.778", "FedAsync"):
        assert part in text


def test_clusters_a_home_another_band_holds_and_lone_homes_are_held() -> None:
    assert unheld_homes(((0, 1, 2), (3, 4)), CLUSTERED, 0.5) is None
    # home 2 (3 s) is out of its group's band (1 +- 0.5) but group 1's (3 +- 1.5) holds
    # it, so it moves rather than drops; homes 0 and 1 sit exactly on the edge (2 +- 1).
    assert unheld_homes(((0, 1, 2), (3,)), (1.0, 1.0, 3.0, 3.0), 0.5) is None
    assert unheld_homes(((0,), (1,)), (0.1, 50.0), 0.5) is None
    # one group, no other band: the far home drops
    assert unheld_homes(((0, 1),), (1.0, 3.0), 0.5) == Unheld(((0, 1.0), (1, 3.0)), 0.5, 2.0)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ConfigError, match="rt_fraction > 0"):
        unheld_homes(((0, 1),), (1.0, 2.0), 0.0)
    with pytest.raises(ConfigError, match="latencies must be > 0"):
        unheld_homes(((0, 1),), (1.0, -2.0), 0.5)
    with pytest.raises(ConfigError, match="beyond the 2 latencies"):
        unheld_homes(((0, 1, 2),), (1.0, 2.0), 0.5)


@st.composite
def grouped(draw: st.DrawFn) -> tuple[tuple[tuple[int, ...], ...], list[float], float]:
    n = draw(st.integers(2, 7))
    lats = draw(st.lists(st.floats(0.05, 60.0), min_size=n, max_size=n))
    labels = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    groups = tuple(tuple(h for h in range(n) if labels[h] == g) for g in range(3))
    return groups, lats, draw(st.floats(0.05, 3.0))


@settings(max_examples=200, deadline=None)
@given(grouped())
def test_the_unheld_homes_are_those_algorithm_1_drops_and_needed_holds_every_group(
    case: tuple[tuple[tuple[int, ...], ...], list[float], float],
) -> None:
    groups, lats, rt = case
    found = unheld_homes(groups, lats, rt)

    def actions(band: float) -> dict[int, str]:
        state = GroupState(groups, tuple(lats), ((1.0,),) * len(lats), rt_fraction=band)
        return {h: regroup(state, h, lats[h]).action for h in range(len(lats))}

    dropped = sorted(h for h, a in actions(rt).items() if a == "drop")
    assert ([h for h, _ in found.homes] if found else []) == dropped
    if found is not None:
        assert all(lat == lats[h] for h, lat in found.homes)
        assert set(actions(found.needed).values()) == {"stay"}
        assert found.needed > rt


def test_the_federation_records_the_warning_for_a_spread_eco_fl_only() -> None:
    eco = federation(make_strategy("ecofl", groups=2, rt_fraction=0.5), [A] * 5)
    end = run_round(eco, range(5), SPREAD)
    assert end is not None and groups_of(eco) == ((0, 1, 2), (3, 4))
    assert end.unheld is not None and end.unheld.homes == ((0, 1.2), (1, 0.45))
    assert end.unheld.needed == pytest.approx(7 / 9)
    later = run_round(eco, (3, 4), (2.0, 2.9), now=5.0)
    assert later is not None and later.unheld is None  # the first round's only
    fast = run_round(eco, (0, 1, 2), SPREAD[:3], now=5.0)  # the warned-of drops come
    assert fast is not None
    assert [(r.home, r.action) for r in fast.regroups] == [(0, "drop"), (2, "drop")]
    clustered = federation(make_strategy("ecofl", groups=2, rt_fraction=0.5), [A] * 5)
    end = run_round(clustered, range(5), CLUSTERED)
    assert end is not None and groups_of(clustered) == ((0, 1, 2), (3, 4))
    assert end.unheld is None
    for name in ("fedat", "fedasync", "fedavg"):  # they drop no home: nothing to warn of
        other = federation(make_strategy(name, groups=2), [A] * 5)
        end = run_round(other, range(5), SPREAD)
        assert end is not None and end.unheld is None


def test_the_service_stores_the_warning_and_the_status_command_shows_it(
    tmp_path: Path, redis_url: str, cluster_name: str
) -> None:
    example = (ROOT / "services/cli/examples/federation-digits.yaml").read_text()
    spec_path = tmp_path / "fed.yaml"
    spec_path.write_text(
        example.replace("homes: 3", "homes: 5").replace(
            "federation_id: digits", "federation_id: h7"
        )
    )
    settings_ = FederationSettings(
        spec=spec_path, bind="tcp://127.0.0.1:0", redis_url=redis_url, cluster=cluster_name
    )
    spec = load_federation(spec_path)
    assert spec.strategy == "ecofl" and spec.rt_fraction == 0.5
    svc = FederationService(settings_, spec)
    try:
        fed = svc.federation
        for home in range(5):
            fed.join(home, 10, (10, *([0] * 9)))
        tasks = {h: fed.task(h, 0.0) for h in range(5)}
        end = None
        for h, lat in enumerate(SPREAD):
            update = {k: v.clone() for k, v in fed.state.items()}
            end = fed.submit(h, tasks[h].round_id, update, 10, lat, lat)
        assert end is not None and end.unheld is not None
        svc._ended(end)
        entries = svc.store.read("fl-metrics", "h7")
        unheld = entries[-1]["unheld"]
        assert unheld["homes"] == [0, 1] and unheld["latencies"] == [1.2, 0.45]
        assert unheld["rt_fraction"] == 0.5
        assert unheld["needed_rt_fraction"] == pytest.approx(7 / 9, abs=1e-4)
        assert unheld["warning"] == end.unheld.warning()
    finally:
        svc.sock.close(0)
        svc.ctx.term()
        svc.store.close()
    shown = CliRunner().invoke(
        app, ["federation", "h7", "--redis-url", redis_url, "--cluster", cluster_name]
    )
    assert shown.exit_code == 0, shown.output
    flat = " ".join(shown.output.split())
    assert "warning: Eco-FL cannot hold its groups: home 0 (1.2 s), home 1 (0.45 s)" in flat
