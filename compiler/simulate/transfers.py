"""What a plan moves and computes per rank: trainer -> inference reads (first hops), trainer -> trainer gathers, quantization
work, and with node-local fan-out the inference -> inference second hops."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from weightplan.runtime.fp8.numerics import BLOCK, span_bands, span_elements
from weightplan.runtime.plan.format import Plan
from weightplan.runtime.plan.schema import DTYPE_SIZES, GATHER, RECEIVER
from weightplan.runtime.tables.fanout import hops


@dataclass(frozen=True)
class PlanTransfers:
    """`read_bytes[t, i]` and `read_descriptors[t, i]`: what inference rank i reads from trainer rank t
    (runs, receiver-side bf16 stage runs, fp8 spans and their scales); `gather_bytes[s, q]` and
    `gather_descriptors[s, q]`: bf16 trainer rank q reads from trainer rank s before quantizing;
    `sender_quant_bytes[t]` and `receiver_quant_bytes[i]`: bf16 bytes each rank quantizes. With node-local fan-out the
    reads are the first hops (`Plan.pulling`: each replicated entry read by its node's puller only), and
    `second_hop_bytes[p, i]`, `second_hop_descriptors[p, i]` what inference rank i reads whole from puller p of its
    node (one descriptor per entry) once p's first hops and quantization finished; None for a plan without fan-out."""

    read_bytes: np.ndarray
    read_descriptors: np.ndarray
    gather_bytes: np.ndarray
    gather_descriptors: np.ndarray
    sender_quant_bytes: np.ndarray
    receiver_quant_bytes: np.ndarray
    second_hop_bytes: np.ndarray | None = None
    second_hop_descriptors: np.ndarray | None = None
    # For delta syncs: the part of read_bytes a delta does not replace (receiver-side fp8 stage copies, always read
    # whole), the bytes each trainer rank serves once (the pages it diffs at publish), and the plan's wire bytes per
    # unit size (2: bf16, 1: fp8 values, 4: fp32 and scales).
    stage_read_bytes: np.ndarray | None = None
    served_bytes: np.ndarray | None = None
    unit_bytes: dict | None = None


def plan_transfers(plan: Plan) -> PlanTransfers:
    """The transfers of one sync of `plan`: first hops as the trainers serve them, then the second hops of a fan-out plan."""
    first = _first_hops(plan.pulling)
    if plan.fanout is None:
        return first
    hop_bytes, hop_desc = second_hop_matrix(plan)
    return dataclasses.replace(first, second_hop_bytes=hop_bytes, second_hop_descriptors=hop_desc)


def second_hop_matrix(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """[puller, peer] bytes and descriptors (one per whole entry) of a fan-out plan's second hops; zeros without fan-out."""
    n_dst = plan.header.dst_ranks
    hop_bytes, hop_desc = np.zeros((n_dst, n_dst)), np.zeros((n_dst, n_dst))
    for peer, puller, dest in hops(plan):
        hop_bytes[puller, peer] += plan.dests[dest].nbytes
        hop_desc[puller, peer] += 1
    return hop_bytes, hop_desc


def _first_hops(plan: Plan) -> PlanTransfers:
    n_src, n_dst = plan.header.src_ranks, plan.header.dst_ranks
    sizes = np.array([DTYPE_SIZES[c[-1]] for c in plan.cast_chains] or [0], dtype=np.int64)
    table = plan.table
    nbytes = (table["count"] * table["length"] * sizes[table["wire"]]).astype(np.float64)
    read_bytes = _per_pair(table["src_rank"], table["dest"], nbytes, [e.ranks for e in plan.dests], n_src, n_dst)
    read_desc = _per_pair(table["src_rank"], table["dest"], table["count"].astype(np.float64),
                          [e.ranks for e in plan.dests], n_src, n_dst)
    stage, spans = plan.stage, plan.spans
    holders = [e.ranks for e in plan.staging]
    pulled = stage["side"] == RECEIVER
    stage_bytes = (stage["length"] * sizes[stage["wire"]]).astype(np.float64)
    stage_read = _per_pair(stage["src_rank"][pulled], stage["stage"][pulled], stage_bytes[pulled], holders, n_src, n_dst)
    read_bytes += stage_read
    read_desc += _per_pair(stage["src_rank"][pulled], stage["stage"][pulled], np.ones(int(pulled.sum())), holders, n_src, n_dst)
    remote = (stage["side"] == GATHER) & (stage["src_rank"] != stage["quant_rank"])
    gather_bytes = np.zeros((n_src, n_src))
    gather_desc = np.zeros((n_src, n_src))
    np.add.at(gather_bytes, (stage["src_rank"][remote], stage["quant_rank"][remote]), stage_bytes[remote])
    np.add.at(gather_desc, (stage["src_rank"][remote], stage["quant_rank"][remote]), 1.0)
    sender_quant = np.zeros(n_src)
    receiver_quant = np.zeros(n_dst)
    served = spans["side"] != RECEIVER
    span_bytes = np.zeros(len(spans["side"]))
    span_desc = np.zeros(len(spans["side"]))
    fp8_values = 0
    for k in range(len(spans["side"])):
        entry = plan.staging[spans["stage"][k]]
        first, count = int(spans["first_block"][k]), int(spans["n_blocks"][k])
        elements = span_elements(entry.shape, first, count)
        if served[k]:
            sender_quant[spans["src_rank"][k]] += 2 * elements
            span_bytes[k] = elements + 4 * count  # fp8 values and float32 scales
            fp8_values += elements
            span_desc[k] = _segments(entry.shape, first, count) + 1
        else:
            receiver_quant[list(entry.ranks)] += 2 * elements
    read_bytes += _per_pair(spans["src_rank"][served], spans["stage"][served], span_bytes[served], holders, n_src, n_dst)
    read_desc += _per_pair(spans["src_rank"][served], spans["stage"][served], span_desc[served], holders, n_src, n_dst)
    served_bytes = np.bincount(table["src_rank"], weights=nbytes, minlength=n_src)[:n_src]
    served_bytes += np.bincount(spans["src_rank"][served], weights=span_bytes[served], minlength=n_src)[:n_src]
    unit_bytes: dict[int, float] = {}
    for unit in np.unique(sizes[table["wire"]]) if len(nbytes) else ():
        unit_bytes[int(unit)] = float(nbytes[sizes[table["wire"]] == unit].sum())
    if fp8_values:
        unit_bytes[1] = unit_bytes.get(1, 0.0) + float(fp8_values)
        unit_bytes[4] = unit_bytes.get(4, 0.0) + 4.0 * float(spans["n_blocks"][served].sum())
    return PlanTransfers(read_bytes, read_desc, gather_bytes, gather_desc, sender_quant, receiver_quant,
                         stage_read_bytes=stage_read, served_bytes=served_bytes, unit_bytes=unit_bytes)


def _per_pair(src_rank: np.ndarray, entry: np.ndarray, values: np.ndarray, ranks: list, n_src: int, n_dst: int) -> np.ndarray:
    """Sum `values` per (trainer rank, table entry), then give each entry's sum to every inference rank holding it."""
    out = np.zeros((n_src, n_dst))
    if not len(values) or not ranks:
        return out
    per_entry = np.bincount(src_rank * len(ranks) + entry, weights=values, minlength=n_src * len(ranks)).reshape(n_src, len(ranks))
    held = np.zeros((len(ranks), n_dst))
    for e, rs in enumerate(ranks):
        held[e, list(rs)] = 1.0
    return per_entry @ held


def _segments(shape: tuple[int, ...], first: int, count: int) -> int:
    """Contiguous destination segments of a span: one per full-width band, else one per row of the band."""
    rows, cols = shape[-2:]
    out = 0
    for _, brow, bcol, n in span_bands(shape, first, count):
        full = bcol == 0 and (bcol + n) * BLOCK >= cols
        out += 1 if full else min(brow * BLOCK + BLOCK, rows) - brow * BLOCK
    return out
