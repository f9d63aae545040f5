"""EPLB: an inference rank's reads of routed-expert slots, mapped through the engine's current physical-to-logical table.

A plan compiled with `--inference ...,ep,eplb=R` (plan header `inference.eplb`) writes every physical expert slot with
the logical expert vLLM's initial arrangement puts there, and no run of an expert tensor crosses a slot (the
compiler's split_expert_slots pass). vLLM's balancer then moves experts between slots and ranks while serving
(`vllm/distributed/eplb/`), so a rank may hold a logical expert that the plan only ever wrote into another rank's
slot. The runs of one logical expert into one slot are the same bytes of the trainers whatever slot they land in, so
rank r's reads of slot s are the plan's runs into the first slot (in vLLM's initial arrangement) that held the
logical expert now in s, with their destination moved to rank r's entry at slot s. Every other read is the plan's.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import PlanMismatchError
from ..plan.format import Plan
from ..plan.header import EplbHeader
from ..plan.schema import DTYPE_SIZES
from .ranks import Reads, reads_of


def initial_arrangement(eplb: EplbHeader) -> np.ndarray:
    """The logical expert of each physical slot as vLLM first arranges them (EplbState's initial map): slot p <
    logical_experts holds expert p, redundant slot logical_experts + i holds expert i mod logical_experts."""
    slot = np.arange(eplb.physical_experts, dtype=np.int64)
    return np.where(slot < eplb.logical_experts, slot, (slot - eplb.logical_experts) % eplb.logical_experts)


def eplb_of(plan: Plan) -> EplbHeader:
    eplb = plan.header.inference.eplb
    if eplb is None:
        raise PlanMismatchError(f"plan {plan.fingerprint[:12]} was not compiled for EPLB (compile-plan --inference "
                                "...,ep,eplb=R): it has no expert slots to map")
    return eplb


def check_expert_map(plan: Plan, expert_map, where: str) -> np.ndarray:
    """The engine's physical-to-logical table as an int64 [MoE layers, physical slots] array, or PlanMismatchError
    naming what does not fit the plan (shape, a slot with no expert, an expert id out of range)."""
    eplb = eplb_of(plan)
    try:
        table = np.asarray(expert_map.cpu() if hasattr(expert_map, "cpu") else expert_map)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise PlanMismatchError(f"{where}: the expert map is not an array of expert ids ({exc})") from None
    want = (len(eplb.layers), eplb.physical_experts)
    if table.ndim == 2 and table.shape[0] == want[0] and table.shape[1] > want[1] and np.all(table[:, want[1]:] == -1):
        table = table[:, :want[1]]  # vLLM pads the table with -1 up to an elastic pool's capacity
    if table.shape != want or table.dtype.kind not in "iu":
        raise PlanMismatchError(f"{where}: the expert map is {table.dtype}{list(table.shape)}; the plan needs integer "
                                f"[{want[0]} MoE layers, {want[1]} physical slots] ({eplb.logical_experts} logical + "
                                f"{eplb.redundant_experts} redundant experts)")
    bad = np.argwhere((table < 0) | (table >= eplb.logical_experts))
    if len(bad):
        layer, slot = bad[0].tolist()
        raise PlanMismatchError(f"{where}: the expert map puts expert {int(table[layer, slot])} in slot {slot} of MoE "
                                f"layer {layer}; the plan has experts 0..{eplb.logical_experts - 1} in every slot")
    return table.astype(np.int64)


def eplb_reads(plan: Plan, rank: int, expert_map) -> dict[int, Reads]:
    """Inference `rank`'s reads (as `reads_of`) with its expert slots filled per `expert_map`, the engine's current
    [MoE layers, physical slots] table of logical expert ids, by trainer rank."""
    eplb = eplb_of(plan)
    table = check_expert_map(plan, expert_map, f"inference rank {rank}")
    slots = _Slots(plan, eplb)
    local = eplb.physical_experts // plan.header.dst_ranks
    # one target per (layer, expert tensor, local slot): the canonical key of the expert the table puts there, and where
    layer_of = np.array([layer for layer, names in enumerate(eplb.layers) for _ in names], dtype=np.int64)
    name_of = np.arange(len(eplb.tensors), dtype=np.int64)  # the key's tensor id: its place in eplb.tensors
    entry_of = np.array([slots.entry[(name, rank)] for name in eplb.tensors], dtype=np.int64)
    experts = table[layer_of, rank * local:(rank + 1) * local]  # [tensor, local slot]
    keys = (name_of[:, None] * eplb.logical_experts + experts).reshape(-1)
    entries = np.repeat(entry_of, local)
    base = np.tile(np.arange(local, dtype=np.int64), len(entry_of)) * slots.slot_bytes[entries]
    out = {}
    for src, reads in reads_of(plan, rank).items():
        out[src] = [reads.take(np.flatnonzero(~slots.is_expert[reads.dest]))]
    for src, (rows, sorted_keys) in slots.canonical.items():
        lo, hi = np.searchsorted(sorted_keys, keys, "left"), np.searchsorted(sorted_keys, keys, "right")
        n = hi - lo
        index = np.repeat(lo - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
        picked = rows.take(index)
        out.setdefault(src, []).append(Reads.from_columns({
            **picked.columns(), "dest": np.repeat(entries, n), "dst_byte": picked.dst_byte + np.repeat(base, n)}))
    merged = {src: Reads.concat(parts) for src, parts in sorted(out.items())}
    # plan (layer) order, as reads_of gives
    return {src: r.take(np.argsort(r.run, kind="stable")) for src, r in merged.items() if len(r)}


def expert_entries(plan: Plan, eplb: EplbHeader) -> np.ndarray:
    """Boolean mask over plan.dests (one extra False at the end): the entries of the EPLB expert tensors."""
    names = set(eplb.tensors)
    return np.array([entry.name in names for entry in plan.dests] + [False], dtype=bool)


class _Slots:
    """Where each logical expert's bytes come from: the plan's runs into the first slot vLLM's initial arrangement gave
    it, by trainer rank, destination offsets made relative to the slot and sorted by key (expert tensor name id x
    logical experts + logical expert; `canonical`)."""

    def __init__(self, plan: Plan, eplb: EplbHeader):
        dests = plan.dests
        self.is_expert = expert_entries(plan, eplb)
        self.name_id = {name: i for i, name in enumerate(eplb.tensors)}
        self.entry: dict[tuple[str, int], int] = {}
        self.slot_bytes = np.zeros(len(dests) + 1, dtype=np.int64)
        names = np.full(len(dests) + 1, -1, dtype=np.int64)
        for i, entry in enumerate(dests):
            if self.is_expert[i]:
                self.slot_bytes[i] = math.prod(entry.shape[1:]) * DTYPE_SIZES[entry.dtype]
                names[i] = self.name_id[entry.name]
                for r in entry.ranks:
                    self.entry[(entry.name, r)] = i
        constants = [c for c in plan.constants if self.is_expert[c.dest]]
        if constants:
            raise PlanMismatchError(f"plan {plan.fingerprint[:12]}: constant writes into the expert tensor "
                                    f"{dests[constants[0].dest].name!r}: EPLB plans map whole expert slots")
        local = eplb.physical_experts // plan.header.dst_ranks
        arrangement = initial_arrangement(eplb)
        first = _first_slot(arrangement)
        parts: dict[int, list[tuple[Reads, np.ndarray]]] = {}
        for holder in sorted(set((first // local).tolist())):
            for src, reads in reads_of(plan, holder).items():
                rows = reads.take(np.flatnonzero(self.is_expert[reads.dest]))
                size = self.slot_bytes[rows.dest]
                at = rows.dst_byte // size
                within = rows.dst_byte - at * size
                crossing = within + (rows.count - 1) * rows.dst_stride + rows.nbytes > size
                if crossing.any():
                    bad = plan.dests[int(rows.dest[np.argmax(crossing)])].name
                    raise PlanMismatchError(f"plan {plan.fingerprint[:12]}: a run into {bad!r} crosses an expert slot; "
                                            "recompile it with this weightplan (EPLB plans split runs at slots)")
                slot = holder * local + at
                expert = arrangement[slot]
                keep = np.flatnonzero(first[expert] == slot)  # the first slot holding its expert
                rows = Reads.from_columns({**rows.columns(), "dst_byte": within}).take(keep)
                parts.setdefault(src, []).append((rows, names[rows.dest] * eplb.logical_experts + expert[keep]))
        self.canonical: dict[int, tuple[Reads, np.ndarray]] = {}
        for src, pieces in parts.items():
            rows, keys = Reads.concat([r for r, _ in pieces]), np.concatenate([k for _, k in pieces])
            order = np.argsort(keys, kind="stable")
            self.canonical[src] = (rows.take(order), keys[order])


def _first_slot(arrangement: np.ndarray) -> np.ndarray:
    """The lowest physical slot holding each logical expert (the initial arrangement holds every one)."""
    return np.unique(arrangement, return_index=True)[1]
