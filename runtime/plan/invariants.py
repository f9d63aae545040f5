"""Plan invariants: the stride and bounds rules the reader and the compiler's verify share; the reader's table checks."""

from __future__ import annotations

import numpy as np
import torch

from ..casts import CHAIN_RULE, is_chain
from ..errors import PlanFormatError
from .columns import Runs
from ..layout.shards import MAX_RANKS
from .header import MAX_ELEMENTS
from .loaded import Plan
from .schema import DTYPE_SIZES, GATHER, RECEIVER, SENDER


def malformed_strides(runs: Runs) -> np.ndarray:
    """Runs breaking the stride rules, ascending: a count below 1, strides on a one-row run (count 1 has strides 0),
    a negative source stride, or destination rows that overlap (a strided run's dst_stride below its length)."""
    plain = runs.count == 1
    return np.flatnonzero((runs.count < 1) | (plain & ((runs.src_stride != 0) | (runs.dst_stride != 0)))
                          | (~plain & ((runs.dst_stride < runs.length) | (runs.src_stride < 0))))


def first_out_of_bounds(runs: Runs, src_limit: np.ndarray, dst_limit: np.ndarray) -> tuple[str, int]:
    """The first run reaching before element 0 or past its limit (elements of the source shard or destination
    tensor it addresses, one per run), source side first: ("source" or "destination", run index), or ("", -1)."""
    for side, off, end, limit in (("source", runs.src_off, runs.src_end(), src_limit),
                                  ("destination", runs.dst_off, runs.dst_end(), dst_limit)):
        bad = np.flatnonzero((off < 0) | (end > limit))
        if len(bad):
            return side, int(bad[0])
    return "", -1


def check_constants(plan: Plan, origin: str) -> None:
    """The reader's rules for the constants table: known destinations, in bounds, finite values."""
    for c in plan.constants:
        if not all(type(x) is int for x in (c.dest, c.dst_off, c.length)) or not 0 <= c.dest < len(plan.dests):
            raise PlanFormatError(f"{origin}: a constant names a destination outside the table")
        if c.length <= 0 or c.dst_off < 0 or c.dst_off + c.length > plan.dests[c.dest].numel:
            raise PlanFormatError(f"{origin}: a constant is empty or reaches outside its destination tensor")
        if type(c.value) not in (int, float, bool) or (type(c.value) is float and not np.isfinite(c.value)):
            raise PlanFormatError(f"{origin}: a constant's value {str(c.value)[:40]} is not a finite number")
        dtype = plan.dests[c.dest].dtype
        if not fits_dtype(c.value, dtype):
            raise PlanFormatError(f"{origin}: a constant's value {str(c.value)[:40]} does not fit destination "
                                  f"{plan.dests[c.dest].name!r} ({dtype})")


def fits_dtype(value: int | float | bool, dtype: str) -> bool:
    """`value` (finite) is one `dtype` holds without overflow: integral and in range for integer dtypes, 0 or 1 for bool,
    within the largest finite magnitude for floating dtypes (Python compares ints and floats exactly)."""
    torch_dtype = getattr(torch, dtype)
    if type(value) is int and not -(1 << 63) <= value < 1 << 63:  # torch takes integer scalars as int64
        return False
    if torch_dtype is torch.bool:
        return value in (0, 1)
    if torch_dtype.is_floating_point:
        return abs(value) <= torch.finfo(torch_dtype).max
    info = torch.iinfo(torch_dtype)
    return (type(value) is not float or value.is_integer()) and info.min <= value <= info.max


def check_runs(plan: Plan, origin: str) -> None:
    """The reader's rules for the run table: indexes in range, positive lengths, stride rules, bounds, known dtypes."""
    runs, sources, dests, chains = plan.table, plan.sources, plan.dests, plan.cast_chains
    for column, table in (("src", sources), ("dest", dests), ("wire", chains)):
        values = runs[column]
        if len(values) and (values.min() < 0 or values.max() >= len(table)):
            raise PlanFormatError(f"{origin}: run column {column!r} indexes outside its table")
    length, count = runs["length"], runs["count"]
    if len(length) and length.min() <= 0:
        raise PlanFormatError(f"{origin}: a run has non-positive length")
    strided = count > 1
    if strided.any():  # the last row's end, offset + (count - 1) * stride + length, must not overflow int64
        reach = (count[strided] - 1).astype(np.float64) * np.maximum(runs["src_stride"][strided], runs["dst_stride"][strided])
        if (reach >= MAX_ELEMENTS).any():
            raise PlanFormatError(f"{origin}: a strided run reaches 2**48 elements or more")
    if len(malformed_strides(runs)):
        raise PlanFormatError(f"{origin}: a strided run has a count below 1, strides on a one-row run, a negative "
                              "source stride or destination rows that overlap")
    ranks = runs["src_rank"]
    if len(ranks) and (ranks.min() < 0 or ranks.max() >= plan.header.src_ranks):
        raise PlanFormatError(f"{origin}: a run names a trainer rank outside the plan's {plan.header.src_ranks}")
    if len(length):
        shard = np.zeros((plan.header.src_ranks, len(sources)), dtype=np.int64)
        for s, r in set(zip(runs["src"].tolist(), ranks.tolist())):
            shard[r, s] = int(np.prod(plan.local_shape(s, r), dtype=np.int64))
        dest_numel = np.array([e.numel for e in dests], dtype=np.int64)
        side, _ = first_out_of_bounds(runs, shard[ranks, runs.src], dest_numel[runs.dest])
        if side:
            what = "source shard" if side == "source" else "destination tensor"
            raise PlanFormatError(f"{origin}: a run reaches outside its {what}")
    for chain in chains:
        if not is_chain(chain, DTYPE_SIZES):
            raise PlanFormatError(f"{origin}: cast chain {list(chain)} is not {CHAIN_RULE}")


def check_quant_tables(plan: Plan, origin: str) -> None:
    """The reader's rules for the fp8 tables: staging, stage runs and block spans index their tables and stay in bounds."""
    stage, spans, staging = plan.stage, plan.spans, plan.staging
    for entry in staging:
        if not (0 <= entry.weight < len(plan.dests) and 0 <= entry.scale < len(plan.dests)):
            raise PlanFormatError(f"{origin}: staging tensor {entry.name!r} names a destination outside the table")
    for table, what in ((stage, "stage run"), (spans, "block span")):
        if len(table["stage"]) and (table["stage"].min() < 0 or table["stage"].max() >= len(staging)):
            raise PlanFormatError(f"{origin}: a {what} indexes outside the staging table")
        if len(table["side"]) and not np.isin(table["side"], (SENDER, RECEIVER, GATHER)).all():
            raise PlanFormatError(f"{origin}: a {what} has a side other than 0 (sender), 1 (receiver) or 2 (gather)")
    if len(stage["length"]):
        if stage["length"].min() <= 0:
            raise PlanFormatError(f"{origin}: a stage run has non-positive length")
        if stage["src"].min() < 0 or stage["src"].max() >= len(plan.sources) or stage["wire"].min() < 0 \
                or stage["wire"].max() >= len(plan.cast_chains):
            raise PlanFormatError(f"{origin}: a stage run indexes outside its tables")
        if stage["src_rank"].min() < 0 or stage["src_rank"].max() >= plan.header.src_ranks:
            raise PlanFormatError(f"{origin}: a stage run names a trainer rank outside the plan's {plan.header.src_ranks}")
        expected_quant = np.where(stage["side"] == SENDER, stage["src_rank"], -1)
        gather = stage["side"] == GATHER
        if (stage["quant_rank"][~gather] != expected_quant[~gather]).any() or (stage["quant_rank"][gather] < 0).any() \
                or (stage["quant_rank"][gather] >= plan.header.src_ranks).any():
            raise PlanFormatError(f"{origin}: a stage run's quant_rank is not its own rank (sender side), -1 (receiver "
                                  "side) or a valid trainer rank (gather side)")
        numel = np.array([e.numel for e in staging], dtype=np.int64)[stage["stage"]]
        if stage["stage_off"].min() < 0 or (stage["stage_off"] + stage["length"] > numel).any():
            raise PlanFormatError(f"{origin}: a stage run reaches outside its staging tensor")
        shard = np.array([int(np.prod(plan.local_shape(s, r), dtype=np.int64))
                          for s, r in zip(stage["src"].tolist(), stage["src_rank"].tolist())], dtype=np.int64)
        if stage["src_off"].min() < 0 or (stage["src_off"] + stage["length"] > shard).any():
            raise PlanFormatError(f"{origin}: a stage run reaches outside its source shard")
    if len(spans["n_blocks"]):
        if spans["n_blocks"].min() <= 0 or spans["first_block"].min() < 0:
            raise PlanFormatError(f"{origin}: a block span is empty or starts before block 0")
        scale_numel = np.array([plan.dests[e.scale].numel for e in staging], dtype=np.int64)[spans["stage"]]
        if (spans["first_block"] + spans["n_blocks"] > scale_numel).any():
            raise PlanFormatError(f"{origin}: a block span reaches past its tensor's last block")
        trainer = spans["side"] != RECEIVER
        if (spans["src_rank"][trainer] < 0).any() or (spans["src_rank"][trainer] >= plan.header.src_ranks).any():
            raise PlanFormatError(f"{origin}: a sender- or gather-side block span names no valid trainer rank")


def fanout_problem(dests, staging_pairs, fanout) -> str:
    """Why a fan-out table is not one every destination byte of every holder is written exactly once by, or "".

    Rules: each listed entry is pulled by ranks holding it, exactly one per node that holds it, and some holder is
    not a puller (it reads the entry whole from its node's puller, which holds every byte of it once its own runs,
    constants and quantization landed: the second hop reads only landed bytes). `staging_pairs` are the (weight,
    scale) destination pairs of the fp8 staging tensors: both or neither listed, with the same pullers.
    """
    g = fanout.gpus_per_node
    if type(g) is not int or not 1 <= g <= MAX_RANKS:
        return f"gpus_per_node {g!r} is not an int in 1..{MAX_RANKS}"
    previous = -1
    pullers = {}
    for row in fanout.first_hops:
        dest, ranks = row
        if type(dest) is not int or not previous < dest < len(dests):
            return f"first hop entry {dest!r} is not a destination index in ascending order"
        previous = dest
        held = dests[dest].ranks
        if not ranks or any(type(r) is not int for r in ranks) or list(ranks) != sorted(set(ranks)) \
                or not set(ranks) <= set(held):
            return f"destination {dests[dest].name!r}: pullers {list(ranks)} are not ascending ranks holding it"
        nodes = [r // g for r in ranks]
        if len(set(nodes)) != len(nodes) or set(nodes) != {r // g for r in held}:
            return f"destination {dests[dest].name!r}: pullers {list(ranks)} are not one per node holding it"
        if len(ranks) == len(held):
            return f"destination {dests[dest].name!r}: every holder pulls it, so it has no second hop"
        pullers[dest] = tuple(ranks)
    for weight, scale in staging_pairs:
        if pullers.get(weight) != pullers.get(scale):
            return (f"fp8 weight {dests[weight].name!r} and scale {dests[scale].name!r} have different pullers: "
                    "one rank quantizes both")
    return ""


def check_fanout(plan: Plan, origin: str) -> None:
    """The reader's rules for the fan-out table (fanout_problem)."""
    if plan.fanout is None:
        return
    problem = fanout_problem(plan.dests, [(e.weight, e.scale) for e in plan.staging], plan.fanout)
    if problem:
        raise PlanFormatError(f"{origin}: fan-out table: {problem}")
