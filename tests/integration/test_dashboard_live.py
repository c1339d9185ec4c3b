"""The operator's view of a real local job with a fault (2 machines x 2 workers, one warm
standby, a GPU Xid on m1): the dashboard in headless Chromium, /metrics parsed with
prometheus_client's parser and compared with the job's report, `stalwart status --watch` on a
terminal and in a pipe, and `stalwart report --html` rendered in the browser. Screenshots go to
$STALWART_ARTIFACTS (or a temp dir; the test prints where)."""
import os
import pty
import re
import select
import subprocess
import sys
import time
import urllib.request

import pytest
from browser import MISSING, console_errors, screenshot, start_browser
from jobrun import gpt_spec, wait_for
from prometheus_client.parser import text_string_to_metric_families
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.support.ui import WebDriverWait

from stalwart.backends.local import LocalCluster
from stalwart.controller.cluster.standby import standby_count
from stalwart.spec import JobSpec

pytestmark = [pytest.mark.browser, pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]
CLI = [sys.executable, "-m", "stalwart.cli"]
EVICTED_RED = "#dc2626"


def scrape(url: str, token: str) -> tuple[dict, float]:
    """{(sample name, sorted labels): value} of one scrape of /metrics, and its seconds; the job's
    job_id/job_name labels left out (one job here: the same on every job-level sample)."""
    t = time.perf_counter()
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    took = time.perf_counter() - t
    out, jobs = {}, set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            if "job_id" in labels:
                jobs.add((labels.pop("job_id"), labels.pop("job_name")))
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    assert len(jobs) == 1, jobs
    return out, took


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def watch_on_a_tty(url: str, token: str, until: str, timeout: float = 30.0) -> str:
    """`stalwart status --watch` under a pseudo-terminal until it has shown `until` twice (two
    refreshes), then stopped; its output."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(CLI + ["status", "--watch", "--interval", "0.5", "--controller", url],
                            stdin=slave, stdout=slave, stderr=slave,
                            env=dict(os.environ, COLUMNS="140", STALWART_TOKEN=token))
    os.close(slave)
    out = b""
    try:
        end = time.time() + timeout
        while time.time() < end and out.decode(errors="replace").count(until) < 2:
            r, _, _ = select.select([master], [], [], 0.2)
            if r:
                try:
                    out += os.read(master, 65536)
                except OSError:
                    break
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        os.close(master)
    return out.decode(errors="replace")


@pytest.fixture
def cluster(tmp_path):
    spec = JobSpec.from_dict(gpt_spec(machines=2, gpus=2, steps=220, standby=1,
                                      chaos=["gpu-xid@step=30,machine=1"]))
    c = LocalCluster(str(tmp_path), spec.machines + standby_count(spec), spec.gpus_per_machine,
                     heartbeat_s=spec.policy.heartbeat_s, missed_beats=spec.policy.missed_beats)
    try:
        c.start()
        yield c, spec
    finally:
        c.stop()


@pytest.mark.timeout(240)
def test_dashboard_metrics_watch_and_report_of_a_job_with_a_fault(cluster, tmp_path):
    c, spec = cluster
    url, client = c.url, c.client()
    driver = start_browser(1400, 1700)
    try:
        job = client.post("/api/jobs", {"spec": spec.to_dict()})["job"]
        driver.get(f"{url}/#token={c.token}")
        WebDriverWait(driver, 30).until(lambda d: d.execute_script(
            "return !!(window.stalwartDash && window.stalwartDash.state.ready)"))

        # the incident reaches the timeline with its cause, live, without a reload
        WebDriverWait(driver, 120, poll_frequency=0.2).until(lambda d: any(
            "gpu_xid" in e.text and "evict_restart" in e.text and "evicted m1" in e.text
            for e in d.find_elements("css selector", "details.incident summary")))
        assert wait_for(lambda: client.get(f"/api/jobs/{job}")["incidents"][0]["resumed_at"] is not None, 60)
        rep = client.get(f"/api/jobs/{job}")
        assert rep["state"] == "running", "the job ended before the live checks: make it longer"
        [inc] = rep["incidents"]
        m1 = next(m for m in rep["machines"] if m["id"] == "m1")
        assert m1["state"] == "evicted" and "xid" in m1["reason"].lower()

        # the machine grid marks m1 evicted; hovering it tells why
        WebDriverWait(driver, 10).until(lambda d: d.execute_script(
            "return window.stalwartDash.cellColor('m1')") == EVICTED_RED)
        grid = driver.find_element("id", "grid")
        off = driver.execute_script("return window.stalwartDash.cellOffset('m1')")
        ActionChains(driver).move_to_element_with_offset(
            grid, off["x"] - grid.rect["width"] / 2, off["y"] - grid.rect["height"] / 2).perform()
        WebDriverWait(driver, 5).until(lambda d: m1["reason"] in d.find_element("id", "tooltip").text)

        # the incident opens to its cause, phases and evidence
        el = driver.find_element("css selector", f'details.incident[data-id="{inc["id"]}"]')
        el.find_element("tag name", "summary").click()
        WebDriverWait(driver, 10).until(lambda d: "Per-phase durations" in el.text and "Evidence" in el.text)
        assert inc["cause"] in el.find_element("css selector", ".cause").text
        assert "chaos_applied" in el.text and "incident_localized" in el.text

        # the ETTR plot keeps moving while the job trains
        def last_x(d) -> float:
            return float(d.execute_script(
                "const s=document.querySelector('#plot-ettr svg');return s?s.dataset.lastX||0:0"))
        x0 = last_x(driver)
        WebDriverWait(driver, 10, poll_frequency=0.2).until(lambda d: last_x(d) > x0 + 0.5)
        assert driver.execute_script("return document.querySelectorAll('#plot-ettr .mark').length") >= 1
        screenshot(driver, "dashboard-live.png")

        # /metrics during the job: the incident counter, the ETTR gauge, request latency
        before, took = scrape(url, c.token)
        for _ in range(5):
            client.get("/api/health")
        # the API and /metrics read one report cache: the scrape's report is the one the API
        # answered just before, or one built between then and the API's next answer (ETTR moves
        # while the job runs, a restart counting against it); its wall time says which
        rep_before = client.get(f"/api/jobs/{job}")
        during, took2 = scrape(url, c.token)
        rep = client.get(f"/api/jobs/{job}")
        assert value(during, "stalwart_incidents_total", symptom="gpu_xid", category="explicit",
                     mechanism="evict_restart") == 1
        assert sum(v for (n, _), v in during.items() if n == "stalwart_incidents_total") == len(rep["incidents"])
        assert value(during, "stalwart_job_state", state="running") == 1
        gauge, wall = value(during, "stalwart_ettr_ratio"), value(during, "stalwart_wall_seconds")
        assert rep_before["wall_s"] <= wall <= rep["wall_s"], (rep_before["wall_s"], wall, rep["wall_s"])
        for r in (rep_before, rep):
            if wall == r["wall_s"]:
                assert gauge == r["ettr"], (gauge, r["ettr"])
        # (a counter shows the highest value it has shown: at least the report's)
        assert value(during, "stalwart_productive_seconds_total") / wall >= gauge - 1e-3
        assert 0 < value(during, "stalwart_ettr_ratio") < 1
        key = {"route": "health", "method": "GET", "code": "200"}
        assert value(during, "stalwart_api_request_duration_seconds_count", **key) - \
            before.get(("stalwart_api_request_duration_seconds_count", tuple(sorted(key.items()))), 0) == 5
        assert value(during, "stalwart_machines", state="evicted") == 1
        assert value(during, "stalwart_machines", state="active") == 2
        assert value(during, "stalwart_restarts_total") == 1
        print(f"/metrics scrape during the job: {took * 1000:.1f} ms and {took2 * 1000:.1f} ms "
              f"(build {value(during, 'stalwart_metrics_build_seconds') * 1000:.1f} ms)")

        # stalwart status --watch on a terminal: refreshed in place by rich
        tty_out = watch_on_a_tty(url, c.token, "sliding ETTR")
        assert "\x1b[" in tty_out and "sliding ETTR" in tty_out and "gpu_xid" in tty_out, tty_out[-2000:]

        assert wait_for(lambda: client.get(f"/api/jobs/{job}")["state"] != "running", 150, every=0.5)
        rep = client.get(f"/api/jobs/{job}")
        assert rep["state"] == "succeeded", rep.get("reason")
        WebDriverWait(driver, 10).until(lambda d: d.find_element("id", "state").text == "succeeded")
        assert console_errors(driver) == []

        # /metrics after the end: gauges equal the report; a counter may lead it by the seconds the
        # ledger's hindsight moved to another bucket after a scrape had counted them
        final, _ = scrape(url, c.token)
        [inc] = rep["incidents"]
        assert value(final, "stalwart_ettr_ratio") == rep["ettr"]
        assert value(final, "stalwart_ettr_window_ratio") == rep["window_ettr"]
        assert value(final, "stalwart_steps_completed") == rep["steps_completed"] == 220
        for b, v in rep["unproductive_s"].items():
            assert v <= value(final, "stalwart_unproductive_seconds_total", bucket=b) <= v + 5.0, b
        assert value(final, "stalwart_job_state", state="succeeded") == 1
        assert value(final, "stalwart_detection_seconds_count") == 1
        assert value(final, "stalwart_detection_seconds_sum") == inc["detection_s"]
        assert value(final, "stalwart_localization_seconds_count") == 1
        assert value(final, "stalwart_localization_seconds_sum") == pytest.approx(
            inc["localized_at"] - inc["detected_at"], abs=1e-9)

        # stalwart status --watch in a pipe: plain lines, ends with the job
        p = subprocess.run(CLI + ["status", "--watch", "--controller", url], capture_output=True,
                           text=True, timeout=60, check=False, env=dict(os.environ, STALWART_TOKEN=c.token))
        assert p.returncode == 0, p.stderr
        assert "\x1b[" not in p.stdout and "succeeded: step 220/220" in p.stdout
        assert "incident " in p.stdout and "evicted m1" in p.stdout

        # stalwart report --html, rendered in the browser
        html_path = str(tmp_path / "report.html")
        p = subprocess.run(CLI + ["report", "--controller", url, "--html", html_path], capture_output=True,
                           text=True, timeout=60, check=False, env=dict(os.environ, STALWART_TOKEN=c.token))
        assert p.returncode == 0, p.stderr
        with open(html_path) as f:
            page = f.read()
        assert "<script" not in page and re.search(r"<[^>]*\s(src|href)\s*=", page) is None
        driver.get("file://" + html_path)
        assert len(driver.find_elements("css selector", "#plots svg.plot")) == 4
        assert driver.find_elements("css selector", 'polyline[data-name="cumulative ETTR"]')
        assert driver.find_elements("css selector", 'polyline[data-name^="sliding ETTR"]')
        assert driver.find_elements("css selector", 'polyline[data-name="steps/s"]')
        assert len(driver.find_elements("css selector", "#plots svg line.mark")) >= 2   # ETTR + throughput
        assert {e.get_attribute("data-key") for e in driver.find_elements("css selector", "rect.bar")} >= \
            {"detection", "localization", "failover"}
        screenshot(driver, "report.png")
        assert console_errors(driver) == []
    finally:
        driver.quit()
