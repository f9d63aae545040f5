"""plan_summary: the figures inspect-plan reports, and its text rendering (a jinja2 template)."""

from __future__ import annotations

import jinja2
import numpy as np

from ..runtime.plan_format import Plan
from .ir import Program, Runs, TensorSpec
from .passes.verify import descriptors_lower_bound, verify

TEXT = jinja2.Template(
    """\
weightplan plan (format {{ s.format_version }})
  model          {{ s.model }} ({{ h.architecture }}), config sha256 {{ h.config_sha256[:16] }}
  vllm           {{ h.vllm_version }} on {{ s.inference.platform }}
  trainer        {{ s.trainer.format }}, {{ s.trainer.dtype }} masters, layout {{ s.trainer.layout }} ({{ s.src_ranks }} ranks)
  inference      {{ s.inference.layout }} ({{ s.dst_ranks }} ranks), quant {{ s.quant }}
  sources        {{ h.sources | length }} trainer tensors
  destinations   {{ s.dst_tensors }} tensors, {{ s.dst_bytes }} bytes, coverage {{ "%.6f" | format(s.dst_coverage) }}
  wire           {{ s.wire_bytes }} bytes
  descriptors    {{ s.descriptors }} (lower bound {{ s.descriptors_lower_bound }})
  fingerprint    {{ s.fingerprint }}
{% for r in runs %}  {{ "%-6d" | format(loop.index0) }} {{ r.src }}[{{ r.src_off }}:+{{ r.length }}] -> {{ r.dest }}[{{ r.dst_off }}:+{{ r.length }}]{{ r.cast }}
{% endfor %}""",
    undefined=jinja2.StrictUndefined,
)


def as_program(plan: Plan) -> Program:
    runs = Runs(**{f: plan.runs[f] for f in Runs.FIELDS})
    return Program(
        sources=tuple(TensorSpec(e.name, e.shape, e.dtype) for e in plan.sources),
        dests=tuple(TensorSpec(e.name, e.shape, e.dtype) for e in plan.dests),
        runs=runs,
        cast_chains=plan.cast_chains,
        meta={"dst_ranks": plan.header["dst_ranks"]},
    )


def summarize(plan: Plan) -> dict:
    h = plan.header
    program = as_program(plan)
    coverage = verify(program, require_full_coverage=False)
    wire = int((plan.runs["length"] * plan.wire_itemsize()).sum()) if plan.n_runs else 0
    return {
        "format_version": h["format_version"],
        "model": h["model"],
        "trainer": h["trainer"],
        "inference": h["inference"],
        "quant": h["quant"],
        "src_ranks": h["src_ranks"],
        "dst_ranks": h["dst_ranks"],
        "dst_tensors": len(plan.dests),
        "dst_bytes": coverage.dst_bytes,
        "wire_bytes": wire,
        "descriptors": plan.n_runs,
        "descriptors_lower_bound": descriptors_lower_bound(program.runs),
        "dst_coverage": coverage.fraction,
        "fingerprint": plan.fingerprint,
    }


def render_text(plan: Plan, summary: dict, runs: int = 0) -> str:
    rows = []
    cols = plan.runs
    for i in range(min(runs, plan.n_runs)):
        chain = plan.cast_chains[cols["wire"][i]]
        rows.append(
            {
                "src": plan.sources[cols["src"][i]].name,
                "src_off": int(cols["src_off"][i]),
                "dest": plan.dests[cols["dest"][i]].name,
                "dst_off": int(cols["dst_off"][i]),
                "length": int(cols["length"][i]),
                "cast": "" if len(chain) == 1 else " (" + " -> ".join(chain) + ")",
            }
        )
    return TEXT.render(s=summary, h=plan.header, runs=rows)
