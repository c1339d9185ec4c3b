"""SVG line charts and stacked bars (controller/report/plots.py): well-formed, self-contained, placed right."""
import math
import xml.etree.ElementTree as ET

import pytest

from stalwart.controller.report.plots import Mark, Series, line_chart, nice_ticks, stacked_bars

NS = "{http://www.w3.org/2000/svg}"


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def test_nice_ticks_are_round_and_cover_the_range():
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0, 97) == [0, 20, 40, 60, 80]
    t = nice_ticks(0.013, 0.0571, 4)
    assert t == [0.02, 0.04]
    assert nice_ticks(3, 3) == [3]
    with pytest.raises(ValueError):
        nice_ticks(0, math.inf)


def test_line_chart_maps_points_into_the_plot_area_and_marks_incidents():
    svg = line_chart([Series("ettr", [(0, 0.0), (50, 0.5), (100, 1.0)])], title="ETTR", x_label="s",
                     y_label="ETTR", marks=[Mark(40, "#1: gpu_xid", x2=60)], width=600, height=200,
                     y_min=0, y_max=1)
    root = parse(svg)
    [line] = root.iter(NS + "polyline")
    pts = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
    assert pts[0][0] < pts[1][0] < pts[2][0]                  # x grows to the right
    assert pts[0][1] > pts[1][1] > pts[2][1]                  # y grows upwards
    assert all(0 <= x <= 600 and 0 <= y <= 200 for x, y in pts)
    assert pts[1][0] == pytest.approx((pts[0][0] + pts[2][0]) / 2)
    marks = [e for e in root.iter() if e.get("class") == "mark"]
    assert {e.tag for e in marks} == {NS + "rect", NS + "line"}
    assert any("#1: gpu_xid" in (t.text or "") for t in root.iter(NS + "title"))


def test_line_chart_breaks_lines_at_missing_values_and_escapes_text():
    svg = line_chart([Series("<loss>", [(0, 1.0), (1, 2.0), (2, None), (3, float("nan")), (4, 1.0), (5, 3.0)])],
                     title="a & b", x_label="step", y_label="loss")
    root = parse(svg)
    assert len(list(root.iter(NS + "polyline"))) == 2
    assert "&lt;loss&gt;" in svg and "a &amp; b" in svg
    assert "<script" not in svg and "href" not in svg


def test_empty_chart_says_so():
    svg = line_chart([Series("x", [])], title="Throughput", x_label="s", y_label="steps/s")
    assert "no data yet" in svg
    parse(svg)


def test_stacked_bars_stack_in_key_order_with_heights_proportional_to_values():
    svg = stacked_bars([("#1", {"detection": 1.0, "failover": 3.0}), ("#2", {"detection": 2.0})],
                       keys=["detection", "failover"], title="per incident")
    rects = [e for e in parse(svg).iter(NS + "rect") if e.get("class") == "bar"]
    assert [r.get("data-key") for r in rects] == ["detection", "failover", "detection"]
    h = [float(r.get("height")) for r in rects]
    assert h[1] == pytest.approx(3 * h[0], rel=0.02) and h[2] == pytest.approx(2 * h[0], rel=0.02)
    # the failover block sits on top of the detection block of the same bar
    assert float(rects[1].get("y")) + h[1] == pytest.approx(float(rects[0].get("y")), abs=0.2)
    assert "nothing to show" in stacked_bars([], keys=["detection"], title="none")
