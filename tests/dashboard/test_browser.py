"""The dashboard in a real headless Chromium during a running job and a recovery.

Debian's `chromium` and `chromium-driver` (Selenium drives the driver on
PATH, nothing is downloaded). The page must show the devices and the plan
while the job runs, then, after a worker is killed as in
tests/integration/test_recovery.py, the recovery and the plan without it.
A screenshot of each moment is saved for a person to look at: in
$ASTEROID_ARTIFACTS, else test-artifacts/ at the repository's root.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.cluster import LocalCluster
from tests.dashboard.harness import job_spec, start_dashboard, until

pytestmark = pytest.mark.integration

WORKERS = ["edge-a", "edge-b", "edge-c", "edge-d"]
VICTIM = "edge-d"
PLAN = {
    "global_batch": 32,
    "microbatches": 4,
    "stages": [
        {"start": 0, "end": 2, "devices": [{"device": "edge-a", "share": 1}]},
        {"start": 2, "end": 4, "devices": [{"device": "edge-b", "share": 1}]},
        {"start": 4, "end": 7, "devices": [{"device": "edge-c"}, {"device": "edge-d"}]},
    ],
}
ROOT = Path(__file__).resolve().parents[2]
DRAWN = (
    "return document.querySelectorAll('#rate polyline, #loss polyline').length === 2"
    " && document.querySelectorAll('#timeline rect').length >= 4"
)
"""The charts have a line each and the timeline four rounds at least."""


def _chromium() -> tuple[str, str]:
    """Debian's browser and its driver, or a skip (a failure under CI=true) naming what lacks."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    missing = [n for n, p in (("chromium", browser), ("chromium-driver", driver)) if p is None]
    if missing:
        why = f"needs {' and '.join(missing)} (apt-get install -y chromium chromium-driver)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    assert browser is not None and driver is not None
    return browser, driver


def _artifacts() -> Path:
    folder = Path(os.environ.get("ASTEROID_ARTIFACTS") or ROOT / "test-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def browser():
    binary, driver_path = _chromium()
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1500,1100"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(driver_path))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.mark.timeout(300)
def test_the_page_shows_the_devices_and_the_plan_that_changes_at_a_recovery(
    tmp_path, redis_url, cluster_name, budget, browser
):
    from selenium.webdriver.common.by import By

    def text(element_id: str) -> str:
        return str(browser.find_element(By.ID, element_id).text)

    def page() -> str:
        return "\n".join(f"#{i}: {text(i)}" for i in ("devices", "job", "plan", "events"))

    cluster = LocalCluster(tmp_path, redis_url, cluster_name, budget=budget)
    try:
        cluster.start_workers(WORKERS)
        url = start_dashboard(cluster, budget.left(60))
        browser.get(url)
        cluster.start_coordinator(job_spec("watched", 400), PLAN)

        def running() -> bool:
            devices, plan, job = text("devices"), text("plan"), text("job")
            return (
                all(w in devices and w in plan for w in WORKERS)
                and "running" in job
                and bool(browser.execute_script(DRAWN))
            )

        until(running, budget.left(120), "the running job on the page", page)
        browser.save_screenshot(str(_artifacts() / "dashboard-running.png"))
        cluster.procs[VICTIM].kill()

        def recovered() -> bool:
            plan = text("plan")
            return (
                "recovered" in text("events")
                and f"lost {VICTIM}" in text("events")
                and all(w in plan for w in WORKERS if w != VICTIM)
                and VICTIM not in plan
            )

        until(recovered, budget.left(120), "the recovery on the page", page)
        until(lambda: "recoveries" in text("job") and "1\nrecoveries" in text("job"),
              budget.left(10), "the recovery counted", page)  # fmt: skip
        browser.save_screenshot(str(_artifacts() / "dashboard-recovery.png"))
        assert not browser.find_element(By.ID, "banner").is_displayed()  # Redis answered
    finally:
        cluster.close()
