"""controller/report/html.py (`stalwart report --html`): one self-contained page with the four plots."""
import time
import xml.etree.ElementTree as ET

from synthjob import write_synthetic_job

from stalwart.controller.report.series import series_payload
from stalwart.controller.report.build import build_report
from stalwart.controller.store.db import Store
from stalwart.controller.report.html import incident_marks, plots, render


def job(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/s.db")
    try:
        j = write_synthetic_job(store, machines=12, standby=2, incidents=2, steps=300, gpus=2)
        now = time.time()
        return build_report(store, j, now=now), series_payload(store.events(j), now, points=50)
    finally:
        store.close()


def test_report_page_is_self_contained_with_four_plots(tmp_path):
    rep, series = job(tmp_path)
    page = render(rep, series)
    assert "<script" not in page and "src=" not in page and "href=" not in page and "@import" not in page
    p = plots(rep, series)
    assert set(p) == {"loss", "throughput", "ettr", "incidents"}
    for svg in p.values():
        root = ET.fromstring(svg)
        assert root.tag.endswith("svg")
        assert svg in page
    ettr = ET.fromstring(p["ettr"])
    names = [e.get("data-name") for e in ettr.iter() if e.tag.endswith("polyline")]
    assert names == ["cumulative ETTR", "sliding ETTR (1 h)"]
    assert sum(1 for e in ettr.iter() if e.get("class") == "mark" and e.tag.endswith("line")) == 2
    bars = [e.get("data-key") for e in ET.fromstring(p["incidents"]).iter() if e.get("class") == "bar"]
    assert bars.count("detection") == 2 and bars.count("failover") == 2


def test_marks_span_detection_to_resume_and_plots_degrade_without_series(tmp_path):
    rep, _ = job(tmp_path)
    marks = incident_marks(rep)
    assert [(m.x, m.x2) for m in marks] == [(i["detected_at"], i["resumed_at"]) for i in rep["incidents"]]
    page = render(rep, None)
    assert "Throughput: no data yet" in page and "ETTR: no data yet" in page
    assert "Loss per step" in page and 'data-name="loss"' in page
