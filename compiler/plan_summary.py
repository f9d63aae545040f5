"""plan_summary: the figures inspect-plan reports, and its text rendering (a jinja2 template)."""

from __future__ import annotations

import jinja2
import numpy as np

from weightplan.runtime.fp8.numerics import span_elements
from weightplan.runtime.plan.format import Plan
from weightplan.runtime.plan.schema import DTYPE_SIZES, GATHER, RECEIVER
from .ir import Constants, Program
from .passes.descriptor_counts import descriptors_lower_bound, descriptors_posted
from .passes.verify import verify
from .passes.verify_quant import verify_quant
from .simulate.transfers import second_hop_matrix

TEXT = jinja2.Template(
    """\
weightplan plan (format {{ s.format_version }})
  model          {{ s.model }} ({{ h.architecture }}), config sha256 {{ h.config_sha256[:16] }}
  vllm           {{ h.vllm_version }} on {{ s.inference.platform }}
{% if s.inference.get("vllm_host") %}  profile        {% for k, v in s.inference.vllm_host | dictsort %}{{ k }} {{ v }}{{ "; " if not loop.last }}{% endfor %}
{% endif %}  trainer        {{ s.trainer.format }}, {{ s.trainer.dtype }} masters, layout {{ s.trainer.token }} ({{ s.src_ranks }} ranks)
  inference      {{ s.inference.token }} ({{ s.dst_ranks }} ranks), quant {{ s.quant }}{% if s.scale_rounding %} ({{ s.scale_rounding }} scale rounding){% endif %}
{% if s.inference.get("lora") %}{% set l = s.inference.lora %}  lora           rank {{ l.rank }}, alpha {{ l.alpha }}, into one slot of max_lora_rank {{ l.max_rank }}; targets {{ l.targets | join(", ") }}
{% endif %}{% if s.inference.get("eplb") %}{% set e = s.inference.eplb %}  eplb           {{ e.logical_experts }} routed + {{ e.redundant_experts }} redundant experts in {{ e.logical_experts + e.redundant_experts }} physical slots, {{ e.layers | length }} MoE layers of {{ e.layers[0] | length }} expert tensors; no run crosses a slot
{% endif %}  sources        {{ h.sources | length }} trainer tensors
  destinations   {{ s.dst_tensors }} tensors ({{ s.dst_entries }} distinct), {{ s.dst_bytes }} bytes, coverage {{ "%.6f" | format(s.dst_coverage) }}
  wire           {{ s.wire_bytes }} bytes{% if s.gather_bytes %} ({{ s.gather_bytes }} between trainer ranks){% endif %}{% if s.fanout %}, first hops only (second hops: fan-out){% endif %}
{% if s.constant_runs %}  constants      {{ s.constant_bytes }} bytes in {{ s.constant_runs }} runs, written by the inference ranks, never on the wire
{% endif %}{% if s.quantized_blocks %}  fp8 blocks     {{ s.quantized_blocks }} in {{ s.quantized_tensors }} tensors, {{ "%.4f" | format(s.sender_quantized_fraction) }} quantized on the sender, {{ "%.4f" | format(s.gather_quantized_fraction) }} gathered on a trainer; {{ s.derived }} derived post-load items
{% endif %}{% if s.fanout %}{% set f = s.fanout %}  fan-out        gpus-per-node {{ f.gpus_per_node }}: {{ f.entries }} replicated entries pulled once per node; per inference rank from the trainers max {{ "%.3f" | format(f.first_hop_max / 1e9) }} GB, mean {{ "%.3f" | format(f.first_hop_mean / 1e9) }} GB (without fan-out {{ "%.3f" | format(f.without_fanout_max / 1e9) }} / {{ "%.3f" | format(f.without_fanout_mean / 1e9) }} GB), second hops from its node's pullers max {{ "%.3f" | format(f.second_hop_max / 1e9) }} GB, mean {{ "%.3f" | format(f.second_hop_mean / 1e9) }} GB
{% endif %}{% if s.unloaded %}  not loaded     {{ s.unloaded | length }} parameters vLLM's load_weights never writes (they keep vLLM's initial values; the plan leaves them alone): {{ s.unloaded | join(", ") }}
{% endif %}  descriptors    {{ s.descriptors }} posted, {{ s.descriptors_stored }} stored (lower bound {{ s.descriptors_lower_bound }})
  balance        trainer ranks {{ "%.3f" | format(s.src_balance) }}, inference ranks {{ "%.3f" | format(s.dst_balance) }} (max/mean bytes)
{% if s.bytes_per_stage_pair %}  stage pairs    bytes per (trainer stage, inference stage):{% for row in s.bytes_per_stage_pair %}{% set i = loop.index0 %}{% for n in row %} ({{ i }},{{ loop.index0 }}) {{ n }}{% endfor %}{% endfor %}
{% endif %}{% if s.source_choice %}{% set c = s.source_choice %}  replicas       {{ c.shared_bytes }} bytes held by several trainer ranks; busiest trainer rank {{ c.greedy_max }} bytes greedy (max/mean {{ "%.4f" | format(c.greedy_max / c.greedy_mean) }}), {{ c.chosen_max }} kept (max/mean {{ "%.4f" | format(c.chosen_max / c.chosen_mean) }}, {{ c.method }})
{% endif %}  fingerprint    {{ s.fingerprint }}
{% for r in runs %}  {{ "%-6d" | format(loop.index0) }} trainer {{ r.src_rank }} {{ r.src }}[{{ r.src_off }}:+{{ r.length }}] -> {{ r.dest }}[{{ r.dst_off }}:+{{ r.length }}]{{ r.rows }}{{ r.cast }}
{% endfor %}""",
    undefined=jinja2.StrictUndefined,
)


def as_program(plan: Plan) -> Program:
    shard_numel = np.zeros((plan.header.src_ranks, len(plan.sources)), dtype=np.int64)
    for s, r in set(zip(plan.table["src"].tolist(), plan.table["src_rank"].tolist())):
        shard_numel[r, s] = int(np.prod(plan.local_shape(s, r), dtype=np.int64))
    return Program(
        sources=plan.sources,  # the plan's entries are the compiler's (runtime/plan/schema.py)
        dests=plan.dests,
        runs=plan.table,
        cast_chains=plan.cast_chains,
        shard_numel=shard_numel,
        constants=Constants(*(np.array([getattr(c, f) for c in plan.constants], dtype=np.int64) for f in ("dest", "dst_off", "length")),
                            tuple(c.value for c in plan.constants)),
    )


def per_rank_bytes(plan: Plan) -> tuple[list[int], list[int], int]:
    """Bytes each inference rank reads, each trainer rank serves (once per reading rank), and trainers read from each other."""
    table = plan.table
    nbytes = (table["count"] * table["length"] * plan.stored_itemsize()).astype(np.float64)
    per_dest = np.bincount(table["dest"], weights=nbytes, minlength=len(plan.dests))
    dst = np.zeros(plan.header.dst_ranks, dtype=np.float64)
    holders = np.zeros(len(plan.dests), dtype=np.int64)
    for i, entry in enumerate(plan.dests):
        dst[list(entry.ranks)] += per_dest[i]
        holders[i] = len(entry.ranks)
    weights = nbytes * holders[table["dest"]] if len(nbytes) else nbytes
    src = np.bincount(table["src_rank"], weights=weights, minlength=plan.header.src_ranks)
    # fp8: receiver-side stage runs carry bf16; sender- and gather-side spans carry fp8 values and float32
    # scales; gather-side stage runs from another trainer rank carry bf16 once, between trainers.
    stage, spans = plan.stage, plan.spans
    sizes = np.array([DTYPE_SIZES[chain[-1]] for chain in plan.cast_chains] or [0], dtype=np.int64)
    for i in np.flatnonzero(stage["side"] == RECEIVER).tolist():
        entry = plan.staging[stage["stage"][i]]
        n = int(stage["length"][i] * sizes[stage["wire"][i]])
        dst[list(entry.ranks)] += n
        src[stage["src_rank"][i]] += n * len(entry.ranks)
    remote = np.flatnonzero((stage["side"] == GATHER) & (stage["src_rank"] != stage["quant_rank"]))
    gathered = stage["length"][remote] * sizes[stage["wire"][remote]]
    src += np.bincount(stage["src_rank"][remote], weights=gathered, minlength=len(src))
    for i in np.flatnonzero(spans["side"] != RECEIVER).tolist():
        entry = plan.staging[spans["stage"][i]]
        n = span_elements(entry.shape, int(spans["first_block"][i]), int(spans["n_blocks"][i])) + 4 * int(spans["n_blocks"][i])
        dst[list(entry.ranks)] += n
        src[spans["src_rank"][i]] += n * len(entry.ranks)
    return [int(x) for x in dst], [int(x) for x in src], int(gathered.sum())


def stage_pair_bytes(plan: Plan) -> list[list[int]]:
    """Bytes the read runs carry per (trainer pipeline stage, inference pipeline stage), once per holding rank: row s is
    trainer stage s (fp8 stage runs and spans are not counted)."""
    h = plan.header
    table = plan.table
    nbytes = (table["count"] * table["length"] * plan.stored_itemsize()).astype(np.float64)
    src_stages, dst_stages = h.trainer.pp or 1, h.inference.pp or 1
    src_stage = np.array([h.trainer.stage_of(r, h.src_ranks) for r in range(h.src_ranks)], dtype=np.int64)[table["src_rank"]]
    holders = np.zeros((len(plan.dests), dst_stages), dtype=np.float64)  # holding ranks of each dest per inference stage
    for i, entry in enumerate(plan.dests):
        for rank in entry.ranks:
            holders[i, h.inference.rank_coords(rank).pp] += 1
    pairs = [np.bincount(src_stage, weights=nbytes * holders[table["dest"], t], minlength=src_stages) for t in range(dst_stages)]
    return np.stack(pairs, axis=1).astype(np.int64).tolist()


def _balance(values: list[int]) -> float:
    mean = sum(values) / len(values) if values else 0
    return max(values) / mean if mean else 1.0


def fanout_figures(plan: Plan, first_hop: list[int]) -> dict | None:
    """A fan-out plan's node size, fanned-out entries, bytes per inference rank from the trainers (`first_hop`) against
    the same plan without fan-out, and second-hop bytes each rank reads from (and serves to) its node's peers."""
    if plan.fanout is None:
        return None
    without, _, _ = per_rank_bytes(plan)  # every holder pulling every entry from the trainers
    hops, hop_descriptors = second_hop_matrix(plan)
    read, served = hops.sum(axis=0), hops.sum(axis=1)
    return {
        "gpus_per_node": plan.fanout.gpus_per_node,
        "entries": len(plan.fanout.first_hops),
        "first_hop_max": max(first_hop), "first_hop_mean": sum(first_hop) / len(first_hop),
        "without_fanout_max": max(without), "without_fanout_mean": sum(without) / len(without),
        "second_hop_max": int(read.max()), "second_hop_mean": float(read.mean()),
        "second_hop_bytes": int(hops.sum()), "second_hop_descriptors": int(hop_descriptors.sum()),
        "second_hop_per_dst_rank": [int(x) for x in read], "served_per_dst_rank": [int(x) for x in served],
    }


def summarize(plan: Plan) -> dict:
    """inspect-plan's figures. With fan-out, bytes and descriptors per inference rank are the first hops (what the trainers
    serve, `Plan.pulling`); `fanout` has the second hops and the figures without fan-out."""
    h = plan.header
    program = as_program(plan)
    coverage = verify(program, require_full_coverage=False)
    quant = verify_quant([e.shape for e in plan.staging], [len(e.ranks) for e in plan.staging], plan.stage, plan.spans)
    quant_bytes = sum((plan.dests[e.weight].nbytes + plan.dests[e.scale].nbytes) * len(e.ranks) for e in plan.staging)
    bytes_dst, bytes_src, gather_bytes = per_rank_bytes(plan.pulling)
    fanout = fanout_figures(plan, bytes_dst)
    hop_descriptors = fanout["second_hop_descriptors"] if fanout else 0
    pulling_dests = plan.pulling.dests
    return {
        "format_version": h.format_version,
        "model": h.model,
        "trainer": {k: v for k, v in h.trainer.to_json().items() if k != "boxes"},
        "inference": h.inference.to_json(),
        "quant": h.quant,
        "scale_rounding": h.quant_layout.scale_rounding.value if h.quant_layout is not None else None,
        "src_ranks": h.src_ranks,
        "dst_ranks": h.dst_ranks,
        "dst_tensors": sum(len(e.ranks) for e in plan.dests),
        "dst_entries": len(plan.dests),
        "dst_bytes": coverage.dst_bytes,
        "wire_bytes": sum(bytes_dst) + gather_bytes,
        "constant_bytes": coverage.constant_bytes,
        "constant_runs": len(plan.constants),
        "gather_bytes": gather_bytes,
        "descriptors": descriptors_posted(program.runs, pulling_dests) + hop_descriptors,
        "descriptors_stored": plan.n_stored_runs,
        "descriptors_lower_bound": descriptors_lower_bound(program.runs, pulling_dests) + hop_descriptors,
        "dst_coverage": (coverage.written_once_bytes + quant_bytes) / coverage.dst_bytes if coverage.dst_bytes else 1.0,
        "quantized_tensors": sum(len(e.ranks) for e in plan.staging),
        "quantized_blocks": quant.blocks,
        "sender_quantized_fraction": quant.sender_fraction,
        "gather_quantized_fraction": quant.gathered_fraction,
        "derived": len(h.derived),
        "unloaded": [f"{e.name} {e.dtype}{list(e.shape)} (inference ranks {list(e.ranks)})" for e in plan.unloaded],
        "bytes_per_dst_rank": bytes_dst,
        "bytes_per_src_rank": bytes_src,
        "src_balance": _balance(bytes_src),
        "dst_balance": _balance(bytes_dst),
        "fanout": fanout,
        "bytes_per_stage_pair": stage_pair_bytes(plan) if (h.trainer.pp or h.inference.pp) else None,
        "source_choice": h.stats.source_choice and h.stats.source_choice.to_json(),  # compile's greedy vs max-flow figures, when replicated
        "fingerprint": plan.fingerprint,
    }


def render_text(plan: Plan, summary: dict, runs: int = 0) -> str:
    rows = []
    cols = plan.table
    for i in range(min(runs, plan.n_stored_runs)):
        chain = plan.cast_chains[cols["wire"][i]]
        rows.append(
            {
                "src_rank": int(cols["src_rank"][i]),
                "src": plan.sources[cols["src"][i]].name,
                "src_off": int(cols["src_off"][i]),
                "dest": plan.dests[cols["dest"][i]].name,
                "dst_off": int(cols["dst_off"][i]),
                "length": int(cols["length"][i]),
                "cast": "" if len(chain) == 1 else " (" + " -> ".join(chain) + ")",
                "rows": "" if cols["count"][i] == 1 else
                f" x{int(cols['count'][i])} rows (strides {int(cols['src_stride'][i])}/{int(cols['dst_stride'][i])})",
            }
        )
    return TEXT.render(s=summary, h=plan.header, runs=rows)
