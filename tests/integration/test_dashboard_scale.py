"""The dashboard of a 1,024-machine job (a synthetic store, a real controller and API, a
real headless Chromium) is interactive within 2 s and stays responsive while it polls.

The 2 s are a figure of the code, measured on a host that runs the rest of a test suite beside it
(on 2 cores, 1.4 s at a load of 5): each timed figure is the best of up to `TRIES` measurements,
as a benchmark takes its best run, and the waits that only check what appears are long."""
import time

import pytest
from browser import MISSING, console_errors, screenshot, start_browser
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.support.ui import WebDriverWait
from synthjob import write_synthetic_job

from stalwart.controller.api.server import ApiServer
from stalwart.controller.service import Controller

pytestmark = [pytest.mark.browser, pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]
TRIES = 3
BOUND_MS = 2000


@pytest.fixture
def big_job(tmp_path):
    ctl = Controller(f"sqlite:///{tmp_path}/stalwart.db", str(tmp_path))
    srv = None
    try:
        job = write_synthetic_job(ctl.store, machines=1024, standby=16, incidents=8, steps=3000)
        srv = ApiServer(ctl, "127.0.0.1", 0)
        srv.start()
        yield f"http://127.0.0.1:{srv.port}", job
    finally:
        if srv is not None:
            srv.stop()
        ctl.close()


@pytest.mark.timeout(120)
def test_dashboard_with_1024_machines_is_interactive_within_2s(big_job):
    url, _ = big_job
    def ready(d) -> bool:
        return d.execute_script("return !!(window.stalwartDash && window.stalwartDash.state.ready)")

    driver, firsts = None, []
    try:
        while len(firsts) < TRIES and (not firsts or min(firsts) >= BOUND_MS):
            if driver is not None:
                driver.quit()
            driver = start_browser()         # each try a first visit: nothing cached in the browser
            driver.get(url + "/")
            WebDriverWait(driver, 30, poll_frequency=0.05).until(ready)
            # performance.now() counts from the navigation's start: page, script, both JSON calls, render
            firsts.append(driver.execute_script("return window.stalwartDash.state.firstRenderMs"))
        first_ms = min(firsts)
        rows = driver.execute_script("return window.stalwartDash.state.grid.rows")
        assert len(rows) == 1024
        assert sum(r[1] == "evicted" for r in rows) == 8 and sum(r[1] == "standby" for r in rows) == 16
        # interactive: hovering an evicted machine shows why it was evicted, at once
        victim = next(r[0] for r in rows if r[1] == "evicted")
        off = driver.execute_script("return window.stalwartDash.cellOffset(arguments[0])", victim)
        grid = driver.find_element("id", "grid")
        w, h = grid.rect["width"], grid.rect["height"]
        hovers: list[float] = []
        while len(hovers) < TRIES and (not hovers or min(hovers) >= BOUND_MS):
            if hovers:                   # off the grid first (just above it): the tooltip hides
                ActionChains(driver).move_to_element_with_offset(grid, 0, -h / 2 - 5).perform()
                WebDriverWait(driver, 10, poll_frequency=0.02).until(
                    lambda d: not d.find_element("id", "tooltip").is_displayed())
            t = time.perf_counter()
            # a real mouse move (selenium scrolls the canvas into view; offsets are from its centre)
            ActionChains(driver).move_to_element_with_offset(grid, off["x"] - w / 2, off["y"] - h / 2).perform()
            WebDriverWait(driver, 10, poll_frequency=0.02).until(
                lambda d: "evicted — GPU Xid 79" in d.find_element("id", "tooltip").text)
            hovers.append((time.perf_counter() - t) * 1000)
        hover_ms = min(hovers)
        assert driver.execute_script("return window.stalwartDash.cellColor(arguments[0])", victim) == "#dc2626"
        # it keeps polling and each refresh of 1,024 machines is cheap
        polls = driver.execute_script("return window.stalwartDash.state.polls")
        WebDriverWait(driver, 10).until(
            lambda d: d.execute_script("return window.stalwartDash.state.polls") >= polls + 2)
        render_ms = driver.execute_script("return window.stalwartDash.state.lastRenderMs")
        long_tasks = driver.execute_script("return window.stalwartDash.longTasks()")
        screenshot(driver, "dashboard-1024.png")
        print(f"1,024 machines: first render {first_ms:.0f} ms after navigation (tries: {firsts}), hover -> "
              f"tooltip {hover_ms:.0f} ms (tries: {[round(x) for x in hovers]}), a poll's fetch+render "
              f"{render_ms:.0f} ms, longest main-thread task {max(long_tasks, default=0):.0f} ms")
        assert first_ms < BOUND_MS, f"first render took {firsts} ms"
        assert hover_ms < BOUND_MS, f"hover -> tooltip took {hovers} ms"
        assert max(long_tasks, default=0) < 1000
        assert console_errors(driver) == []
    finally:
        if driver is not None:
            driver.quit()
