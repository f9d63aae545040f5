"""The HTML plan report: summary, trainer x inference byte heat map, per-rank bars and (with a cluster) the simulated timeline, as inline SVG."""

from __future__ import annotations

from pathlib import Path

import jinja2
import numpy as np

from weightplan.runtime.errors import WeightplanError
from weightplan.runtime.files import write_atomically
from weightplan.runtime.plan.format import Plan
from .model import Prediction
from .transfers import PlanTransfers

PHASE_COLOURS = {"gather": "#8e6c8a", "sender-quantize": "#d08c3a", "read": "#3a78b5", "receiver-quantize": "#5a9e5a",
                 "second-hop": "#c0504d"}
FIRST_HOP, SECOND_HOP = PHASE_COLOURS["read"], PHASE_COLOURS["second-hop"]

PAGE = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined).from_string(
    """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>weightplan: {{ title }}</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }
table.summary td { padding: 1px 12px 1px 0; vertical-align: top; }
table.summary td:first-child { color: #666; }
h2 { margin-top: 1.6em; font-size: 17px; }
svg text { font: 11px system-ui, sans-serif; fill: #333; }
.note { color: #666; }
</style></head><body>
<h1>{{ title }}</h1>
<table class="summary">{% for k, v in summary %}<tr><td>{{ k }}</td><td>{{ v }}</td></tr>{% endfor %}</table>

{% for matrix in matrices %}<h2>{{ matrix.title }}</h2>
<p class="note">Darker is more; maximum cell {{ matrix.max_label }}. Hover a cell for its bytes.</p>
<svg id="{{ matrix.id }}" xmlns="http://www.w3.org/2000/svg" width="{{ matrix.width }}" height="{{ matrix.height }}">
{% for c in matrix.cells %}<rect x="{{ c.x }}" y="{{ c.y }}" width="{{ c.w }}" height="{{ c.h }}" fill="{{ c.fill }}"><title>{{ c.title }}</title></rect>
{% endfor %}{% for t in matrix.labels %}<text x="{{ t.x }}" y="{{ t.y }}" text-anchor="{{ t.anchor }}">{{ t.text }}</text>
{% endfor %}</svg>
{% endfor %}

{% for chart in bars %}<h2>{{ chart.title }}</h2>
{% if chart.note %}<p class="note">{{ chart.note }}</p>{% endif %}
<svg class="rank-bars" xmlns="http://www.w3.org/2000/svg" width="{{ chart.width }}" height="{{ chart.height }}">
{% for b in chart.bars %}<rect class="{{ b.cls }}" x="{{ b.x }}" y="{{ b.y }}" width="{{ b.w }}" height="{{ b.h }}" fill="{{ b.fill }}"><title>{{ b.title }}</title></rect>
{% endfor %}{% for t in chart.labels %}<text x="{{ t.x }}" y="{{ t.y }}" text-anchor="{{ t.anchor }}">{{ t.text }}</text>
{% endfor %}</svg>
{% endfor %}
{% if timeline %}<h2>Simulated timeline: the critical path's ranks, then the busiest inference ranks ({{ timeline.cluster }}, predicted sync {{ timeline.sync }})</h2>
<p class="note">{% for phase, colour in phases %}<span style="color: {{ colour }}">&#9632;</span> {{ phase }} {% endfor %}&mdash; a model, not a measurement; per rank, one bar per phase from its first task's start to its last task's end (hover for the count); the percentage is the rank's busiest NIC or link.</p>
<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{{ timeline.width }}" height="{{ timeline.height }}">
{% for b in timeline.bars %}<rect class="{{ b.phase }}" x="{{ b.x }}" y="{{ b.y }}" width="{{ b.w }}" height="{{ b.h }}" fill="{{ b.fill }}" opacity="0.75"><title>{{ b.title }}</title></rect>
{% endfor %}{% for t in timeline.labels %}<text x="{{ t.x }}" y="{{ t.y }}" text-anchor="{{ t.anchor }}">{{ t.text }}</text>
{% endfor %}</svg>
{% else %}<p class="note">No timeline: give <code>simulate-plan PLAN --cluster FILE --html OUT</code> a cluster file to add one.</p>{% endif %}
</body></html>
"""
)


def write_report(out: Path | str, plan: Plan, summary: dict, transfers: PlanTransfers, prediction: Prediction | None = None) -> None:
    """Render the report into one self-contained HTML file (no scripts, no network)."""
    write_atomically(Path(out), render_report(plan, summary, transfers, prediction).encode(), WeightplanError, "HTML report")


def render_report(plan: Plan, summary: dict, transfers: PlanTransfers, prediction: Prediction | None = None) -> str:
    h = plan.header
    rows = [
        ("model", f"{h.model} ({h.architecture})"),
        ("trainer", f"{summary['trainer']['format']}, {summary['trainer']['dtype']}, {summary['trainer']['token']} ({summary['src_ranks']} ranks)"),
        ("inference", f"{summary['inference']['token']} ({summary['dst_ranks']} ranks), quant {summary['quant']}"),
        ("destination bytes", f"{summary['dst_bytes']:,} in {summary['dst_tensors']:,} tensors, coverage {summary['dst_coverage']:.6f}"),
        ("wire bytes", f"{summary['wire_bytes']:,}" + (", first hops (from the trainers)" if summary.get("fanout") else "")),
        ("descriptors", f"{summary['descriptors']:,} posted (lower bound {summary['descriptors_lower_bound']:,})"),
        ("balance (max/mean)", f"trainer ranks {summary['src_balance']:.3f}, inference ranks {summary['dst_balance']:.3f}"),
        ("fingerprint", summary["fingerprint"]),
    ]
    fanout = summary.get("fanout")
    if fanout:
        rows.insert(5, ("fan-out", f"gpus-per-node {fanout['gpus_per_node']}: {fanout['entries']:,} replicated entries pulled once "
                                   f"per node; per inference rank from the trainers max {_gb(fanout['first_hop_max'])} "
                                   f"(without fan-out {_gb(fanout['without_fanout_max'])}), second hops from its node's "
                                   f"pullers max {_gb(fanout['second_hop_max'])}"))
    if prediction is not None:
        d = prediction.as_dict()
        rows.append(("predicted sync", f"{prediction.sync_s:.3f} s on {prediction.cluster} (model)"))
        rows.append(("critical path", " → ".join(f"{s['phase']} {s['task']} [{s['limited_by']}]" for s in d["critical_path"])))
    matrices = [_matrix(transfers.read_bytes, "byte-matrix", "Bytes from each trainer rank (rows) to each inference rank (columns)"
                        + (", first hops" if fanout else ""), "trainer", "inference")]
    bars = [_bars("Bytes each trainer rank serves", "trainer", [summary["bytes_per_src_rank"]])]
    if fanout:
        matrices.append(_matrix(transfers.second_hop_bytes, "second-hop-matrix", "Second hops: bytes each inference rank "
                                "(columns) reads from a puller of its node (rows)", "inference", "inference"))
        bars += [_bars("Bytes each inference rank reads: from the trainers (first hops), then from its node's pullers "
                       "(second hops)", "inference", [summary["bytes_per_dst_rank"], fanout["second_hop_per_dst_rank"]],
                       note="first hops over the NIC (blue), second hops over the node's link (red), stacked"),
                 _bars("Bytes each inference rank serves to its node's peers (second hops)", "inference",
                       [[0] * len(fanout["served_per_dst_rank"]), fanout["served_per_dst_rank"]])]
    else:
        bars.append(_bars("Bytes each inference rank reads", "inference", [summary["bytes_per_dst_rank"]]))
    return PAGE.render(
        title=f"{h.model} {summary['trainer']['token']} → {summary['inference']['token']} ({summary['quant']})",
        summary=rows, matrices=matrices, bars=bars,
        timeline=_timeline(prediction) if prediction is not None else None,
        phases=[(p, c) for p, c in PHASE_COLOURS.items() if p != "second-hop" or fanout],
    )


def _gb(x: float) -> str:
    return f"{x / 1e9:.3f} GB"


MAX_CELLS = 128  # per axis of a heat map: more ranks than this are drawn in bins of consecutive ranks
MAX_BARS = 512  # per bar chart, likewise


def _bins(n: int, limit: int) -> np.ndarray:
    """Start indices of at most `limit` bins of consecutive ranks covering 0..n-1 (one rank per bin when n <= limit)."""
    return np.unique(np.arange(min(n, limit)) * n // max(min(n, limit), 1))


def _span(side: str, starts: np.ndarray, k: int, n: int) -> str:
    last = (starts[k + 1] if k + 1 < len(starts) else n) - 1
    return f"{side} {starts[k]}" if last == starts[k] else f"{side} ranks {starts[k]}-{last}"


def _matrix(m: np.ndarray, svg_id: str, title: str, rows_side: str, cols_side: str, cell_max: int = 14, left: int = 70,
            top: int = 20) -> dict:
    n_rows, n_cols = m.shape
    row_bins, col_bins = _bins(n_rows, MAX_CELLS), _bins(n_cols, MAX_CELLS)
    if m.size:  # sums over bins of consecutive ranks: the page stays bounded for any rank count
        m = np.add.reduceat(np.add.reduceat(m, row_bins, axis=0), col_bins, axis=1)
    rows, cols = len(row_bins), len(col_bins)
    cell = max(2, min(cell_max, 900 // max(cols, 1), 900 // max(rows, 1)))
    peak = float(m.max(initial=0.0)) or 1.0
    cells = []
    for t, i in zip(*np.nonzero(m >= 0)):
        level = m[t, i] / peak
        shade = int(round(255 - 200 * level))
        cells.append({"x": left + i * cell, "y": top + t * cell, "w": cell, "h": cell,
                      "fill": f"rgb({shade},{shade},255)" if m[t, i] else "#f4f4f4",
                      "title": f"{_span(rows_side, row_bins, t, n_rows)} -> {_span(cols_side, col_bins, i, n_cols)}: "
                               f"{int(m[t, i]):,} bytes"})
    labels = [{"x": left - 6, "y": top + cell * 0.8, "text": f"{rows_side} 0", "anchor": "end"},
              {"x": left - 6, "y": top + rows * cell, "text": f"{rows_side} {n_rows - 1}", "anchor": "end"},
              {"x": left, "y": top - 6, "text": f"{cols_side} 0", "anchor": "start"},
              {"x": left + cols * cell, "y": top - 6, "text": f"{n_cols - 1}", "anchor": "end"}]
    return {"id": svg_id, "title": title, "cells": cells, "labels": labels, "width": left + cols * cell + 10,
            "height": top + rows * cell + 10, "max_label": _gb(peak)}


def _bars(title: str, side: str, stacks: list[list[int]], note: str = "", height: int = 120, left: int = 70, top: int = 10) -> dict:
    """One bar per rank (per bin of consecutive ranks beyond MAX_BARS); with two value lists, first hops (blue) with
    second hops (red) stacked on top."""
    n_ranks = len(stacks[0]) if stacks else 0
    starts = _bins(n_ranks, MAX_BARS)
    if n_ranks > len(starts):
        stacks = [np.add.reduceat(np.asarray(vs, dtype=np.int64), starts).tolist() for vs in stacks]
    totals = [sum(vs) for vs in zip(*stacks)]
    n = len(totals)
    width = max(2, min(24, 900 // max(n, 1)))
    peak = max(totals, default=0) or 1
    bars = []
    for k, values in enumerate(zip(*stacks)):
        base = 0
        for v, (cls, fill, what) in zip(values, (("first-hop", FIRST_HOP, " first hop" if len(stacks) > 1 else ""), ("second-hop", SECOND_HOP, " second hop"))):
            if v or (cls == "first-hop" and len(stacks) == 1):
                bars.append({"x": left + k * width, "y": top + height - height * (base + v) / peak, "w": max(width - 1, 1),
                             "h": height * v / peak, "fill": fill, "cls": cls,
                             "title": f"{_span(side, starts, k, n_ranks)}: {v:,}{what} bytes"})
            base += v
    labels = [{"x": left - 6, "y": top + 10, "text": _gb(peak), "anchor": "end"},
              {"x": left - 6, "y": top + height, "text": "0", "anchor": "end"},
              {"x": left, "y": top + height + 14, "text": f"{side} 0", "anchor": "start"},
              {"x": left + n * width, "y": top + height + 14, "text": f"{n_ranks - 1}", "anchor": "end"}]
    return {"title": title, "note": note, "bars": bars, "labels": labels, "width": left + n * width + 20,
            "height": top + height + 24}


def _timeline(prediction: Prediction, ranks: int = 8, width: int = 900, left: int = 110, row: int = 22, top: int = 10) -> dict:
    lanes = prediction.timeline(ranks)
    span = prediction.sync_s or 1.0
    bars, labels = [], []
    for k, lane in enumerate(lanes):
        y = top + k * row
        labels.append({"x": left - 6, "y": y + row * 0.65, "text": f"{lane['rank']} ({lane['busy']:.0%})", "anchor": "end"})
        n = max(len(lane["bars"]), 1)
        for j, b in enumerate(lane["bars"]):  # the phases of a lane share its height
            h = (row - 4) / n
            bars.append({"x": left + width * b["start"] / span, "y": y + 2 + j * h, "w": max(width * (b["end"] - b["start"]) / span, 0.5),
                         "h": max(h, 0.5), "fill": PHASE_COLOURS.get(b["phase"], "#999"), "phase": b["phase"],
                         "title": f"{lane['rank']}: {b['tasks']} {b['phase']} task(s), {b['start']:.4f} -> {b['end']:.4f} s"})
    bottom = top + len(lanes) * row
    labels += [{"x": left, "y": bottom + 14, "text": "0 s", "anchor": "start"},
               {"x": left + width, "y": bottom + 14, "text": f"{span:.3f} s", "anchor": "end"}]
    return {"bars": bars, "labels": labels, "width": left + width + 20, "height": bottom + 24, "cluster": prediction.cluster,
            "sync": f"{prediction.sync_s:.3f} s"}
