"""The per-ID chart (browser/chart.py) as a reader sees it: the SVG is parsed, nothing is served."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from cedana_airflow.airflow.browser.chart import checkpoint_chart
from cedana_airflow.format.manifest import Manifest, ProcessInfo
from cedana_airflow.store.restores import RestoreRecord

NS = {"s": "http://www.w3.org/2000/svg"}
PROC = ProcessInfo(pid=42, command=("python", "train.py"), cwd="/", stdout_pipe="pipe:[1]", stderr_pipe="pipe:[2]")
NOON = datetime(2025, 1, 15, 12, 0, tzinfo=timezone.utc)  # winter: Berlin is UTC+1
MIB = 1 << 20
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _m(seq: int, at: datetime, stored: int = 100 * MIB, image: int = 300 * MIB, freeze: float = 0.5,
       node: str = "gpu-3", try_number: int = 1) -> Manifest:
    return Manifest(checkpoint_id="train-1", seq=seq, try_number=try_number, node=node, created_at=at,
                    engine_version="4.1.1", process=PROC, files=(), image_bytes=image, stored_bytes=stored,
                    freeze_seconds=freeze)


def _restore(at: datetime, seq: int | None = None) -> RestoreRecord:
    return RestoreRecord(checkpoint_id="train-1", outcome="restored" if seq else "fresh", seq=seq, try_number=2,
                         from_node="gpu-3", node="gpu-9", at=at)


FIVE = [_m(i + 1, NOON + timedelta(minutes=10 * i), stored=(i + 1) * 64 * MIB, freeze=0.4 + 0.3 * i) for i in range(5)]


def _svg(manifests: list[Manifest], restores: tuple[RestoreRecord, ...] | list[RestoreRecord] = (), **kw) -> ET.Element:
    out = checkpoint_chart(manifests, restores, **kw)
    assert out is not None
    return ET.fromstring(str(out))


def _texts(svg: ET.Element, cls: str) -> list[str]:
    return [t.text or "" for t in svg.iterfind(f".//s:text[@class='{cls}']", NS)]


def _bytes(label: str) -> float:
    num, unit = label.split()
    return float(num.replace(",", "")) * UNITS[unit]


def _bar_centres(svg: ET.Element) -> list[float]:
    return [float(r.get("x", "")) + float(r.get("width", "")) / 2 for r in svg.iterfind("./s:g[@class='ckpt']/s:rect[@class='bar']", NS)]


def test_one_bar_per_checkpoint_each_labelled_by_seq_with_its_image_behind():
    svg = _svg(FIVE)
    assert len(svg.findall("./s:g[@class='ckpt']/s:rect[@class='bar']", NS)) == 5
    assert len(svg.findall("./s:g[@class='ckpt']/s:rect[@class='image']", NS)) == 5
    assert _texts(svg, "seq") == ["#1", "#2", "#3", "#4", "#5"]
    centres = _bar_centres(svg)
    assert centres == sorted(centres)  # left to right in time
    assert len(svg.findall("./s:circle[@class='freeze-dot']", NS)) == 5
    assert len(svg.find("./s:polyline[@class='freeze']", NS).get("points", "").split()) == 5


def test_size_ticks_read_in_binary_units_ascending_and_a_bar_reaches_its_value():
    svg = _svg(FIVE)
    labels = _texts(svg, "ytick")
    assert 4 <= len(labels) <= 6 and all(re.fullmatch(r"[\d.,]+ (B|KiB|MiB|GiB)", s) for s in labels), labels
    values = [_bytes(s) for s in labels]
    assert values[0] == 0 and values == sorted(values) and len(set(values)) == len(values)
    assert values[-1] >= 320 * MIB  # the biggest stored bar fits under the top tick
    # seq 4 stored exactly 256 MiB: its bar top is the 256 MiB gridline
    grid = {s: float(g.get("y1", "")) for s, g in zip(labels, svg.iterfind(".//s:line[@class='grid']", NS))}
    bar4 = svg.findall("./s:g[@class='ckpt']/s:rect[@class='bar']", NS)[3]
    assert float(bar4.get("y", "")) == pytest.approx(grid["256 MiB"], abs=0.11)
    freeze = _texts(svg, "ftick")
    assert all(s.endswith(" s") for s in freeze) and [float(s[:-2]) for s in freeze] == sorted(float(s[:-2]) for s in freeze)


def test_time_ticks_are_in_the_given_zone():
    utc, berlin = _svg(FIVE), _svg(FIVE, tz=ZoneInfo("Europe/Berlin"))
    assert "12:00" in _texts(utc, "xtick") and _texts(utc, "xtitle") == ["time (UTC)"]
    assert "13:00" in _texts(berlin, "xtick") and "12:00" not in _texts(berlin, "xtick")
    assert _texts(berlin, "xtitle") == ["time (Europe/Berlin)"]
    assert 4 <= len(_texts(utc, "xtick")) <= 6
    title = berlin.find(".//s:g[@class='ckpt']/s:title", NS)
    assert title is not None and "2025-01-15 13:00:00 CET" in (title.text or "")


@pytest.mark.parametrize("step, pattern", [(timedelta(seconds=30), r"\d\d:\d\d:\d\d"),  # 2 min: seconds
                                           (timedelta(minutes=10), r"\d\d:\d\d"),
                                           (timedelta(days=1), r"[A-Z][a-z]{2} \d\d.*")])  # 4 days: dates
def test_time_labels_fit_the_span(step: timedelta, pattern: str):
    labels = _texts(_svg([_m(i + 1, NOON + i * step) for i in range(5)]), "xtick")
    assert 2 <= len(labels) <= 6 and all(re.fullmatch(pattern, s) for s in labels), labels


def test_a_restore_line_stands_between_the_checkpoints_around_it():
    restored = [_restore(NOON + timedelta(minutes=15), seq=2), _restore(NOON + timedelta(minutes=35), seq=4)]
    fresh = _restore(NOON - timedelta(minutes=5))
    svg = _svg(FIVE, [*restored, fresh])
    centres = _bar_centres(svg)
    drawn = svg.findall("./s:g[@class='mark']/s:line[@class='restore']", NS)
    lines = [float(li.get("x1", "")) for li in drawn]
    assert len(lines) == 2
    assert centres[1] < lines[0] < centres[2] and centres[3] < lines[1] < centres[4]
    assert lines[0] == pytest.approx((centres[1] + centres[2]) / 2, abs=0.2)  # 12:15 is halfway from 12:10 to 12:20
    (f,) = svg.findall("./s:g[@class='mark']/s:line[@class='fresh']", NS)
    assert float(f.get("x1", "")) < centres[0] and _texts(svg, "fresh-label") == ["fresh"]
    assert f.get("stroke-dasharray") != drawn[0].get("stroke-dasharray")  # told apart without colour too
    assert _texts(svg, "restore-label") == ["restored seq 2 / try 2", "restored seq 4 / try 2"]
    assert svg.get("aria-label") == "5 checkpoints, 320 MiB newest, freeze 0.4-1.6 s, 2 restores, 1 fresh start"


def test_every_mark_has_a_tooltip_and_the_legend_names_them():
    svg = _svg(FIVE, [_restore(NOON + timedelta(minutes=15), seq=2)])
    marks = svg.findall(".//s:g[@class='ckpt']", NS) + svg.findall("./s:circle[@class='freeze-dot']", NS)
    for mark in marks:
        tip = mark.findtext("s:title", "", NS)
        for part in ("seq ", "try 1", "node gpu-3", "MiB", "freeze ", "2025-01-15 12:"):
            assert part in tip, (part, tip)
    assert "restored seq 2" in svg.findtext(".//s:g[@class='mark']/s:title", "", NS)
    legend = [t.text for t in svg.iterfind(".//s:g[@class='legend']/s:text", NS)]
    assert legend == ["stored size", "image size", "freeze (right axis)", "restore", "fresh start"]


def test_it_fits_any_frame_and_says_what_it_shows():
    svg = _svg(FIVE)
    assert svg.get("viewBox") == "0 0 960 260" and svg.get("width") == "100%" and svg.get("height") is None
    assert svg.get("preserveAspectRatio") and svg.get("role") == "img"
    out = str(checkpoint_chart(FIVE, []))
    assert "#" not in re.sub(r">#\d+<", "", out)  # colours are theme variables, never fixed
    assert "var(--accent)" in out and "currentColor" in out


def test_a_hostile_node_name_is_text_not_markup():
    evil = "<script>alert(1)</script>\"'&"
    out = str(checkpoint_chart([_m(1, NOON, node=evil)], [_restore(NOON, seq=1).model_copy(update={"node": evil})]))
    assert "<script>" not in out and "&lt;script&gt;" in out
    svg = ET.fromstring(out)
    assert svg.find(".//s:script", NS) is None and svg.find(".//script") is None
    assert evil in svg.findtext(".//s:g[@class='ckpt']/s:title", "", NS)


def test_no_manifests_no_chart():
    assert checkpoint_chart([], []) is None
    assert checkpoint_chart([], [_restore(NOON, seq=1)]) is None


def _finite_everywhere(out: str) -> None:
    assert not re.search(r"nan|inf", out, re.I), out
    for el in list(ET.fromstring(out).iter())[1:]:  # the <svg> itself is width="100%"
        for k in ("x", "y", "x1", "x2", "y1", "y2", "cx", "cy", "width", "height", "r"):
            if k in el.attrib:
                assert math.isfinite(float(el.attrib[k])), (el.tag, k, el.attrib[k])
        for k in ("width", "height"):
            if el.tag.endswith("rect") and k in el.attrib:
                assert float(el.attrib[k]) >= 0


@pytest.mark.parametrize("manifests", [
    [_m(1, NOON)],  # one checkpoint
    [_m(i + 1, NOON) for i in range(4)],  # all at the same instant
    [_m(i + 1, NOON + timedelta(minutes=i), stored=0, image=0, freeze=0.0) for i in range(3)],  # nothing stored
    [_m(1, NOON, stored=0, image=0, freeze=0.0)],  # all of it at once
], ids=["one", "same-time", "zero", "one-zero"])
def test_degenerate_inputs_draw_finite_numbers(manifests: list[Manifest]):
    out = checkpoint_chart(manifests, [_restore(NOON, seq=1)])
    assert out is not None
    _finite_everywhere(str(out))
    svg = ET.fromstring(str(out))
    assert len(svg.findall("./s:g[@class='ckpt']/s:rect[@class='bar']", NS)) == len(manifests)
    assert len(_texts(svg, "ytick")) >= 2 and len(_texts(svg, "xtick")) >= 2  # still readable axes


def test_dense_bars_keep_their_labels_apart():
    many = [_m(i + 1, NOON + timedelta(seconds=20 * i)) for i in range(200)]
    svg = _svg(many)
    assert len(svg.findall("./s:g[@class='ckpt']/s:rect[@class='bar']", NS)) == 200
    xs = [float(t.get("x", "")) for t in svg.iterfind(".//s:text[@class='seq']", NS)]
    assert 10 <= len(xs) <= (960 - 64 - 52) // 28 + 1
    assert all(b - a >= 28 for a, b in zip(xs, xs[1:]))
    _finite_everywhere(str(checkpoint_chart(many, [], width=320, height=120)))
