"""An inference rank's per-sync tables: its reads by trainer rank, their pipeline groups and the READ descriptors it posts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..plan.columns import ColumnTable
from ..plan.format import Plan
from .quant import held_stages
from .ranks import Reads, RemoteRegion, contiguous_starts, packing, pipeline_groups, reads_of, row_pieces
from .ring import ring_chunks

_NO_READS = Reads.empty()


@dataclass(frozen=True)
class Descriptors(ColumnTable):
    """The READs posted to one trainer rank: remote side as (exposed region index or RemoteRegion, offset), local as addresses."""

    region: np.ndarray
    remote_off: np.ndarray
    local: np.ndarray
    nbytes: np.ndarray
    group: np.ndarray
    chunk: np.ndarray  # ring chunk of a packed READ when the trainer serves them through a ring, else -1


def descriptor_table(reads: Reads, group: np.ndarray, packed: np.ndarray, local: np.ndarray,
                     chunk: np.ndarray | None = None) -> Descriptors:
    """Runs read in place: one descriptor per row (per run where contiguous on both sides); packed runs (`packed`:
    offset in the packed region or ring, -1 if read in place; `chunk`: their ring chunk): one per run where the
    destination rows continue each other, merged wherever both sides are contiguous within one chunk."""
    chunk = np.full(len(reads), -1, dtype=np.int64) if chunk is None else chunk
    single = reads.count == 1
    direct = np.flatnonzero(packed < 0)
    d = reads.take(direct)
    run, size, (remote, lo) = row_pieces(d.count, d.nbytes, d.contiguous(), (d.src_byte, d.src_stride),
                                         (local[direct], d.dst_stride))
    direct_group = group[direct][run]
    rows = np.flatnonzero(packed >= 0)
    rows = rows[np.argsort(packed[rows], kind="stable")]
    p = reads.take(rows)
    prun, n, (po, plo) = row_pieces(p.count, p.nbytes, single[rows] | (p.dst_stride == p.nbytes),
                                    (packed[rows], p.nbytes), (local[rows], p.dst_stride))
    g, c = group[rows][prun], chunk[rows][prun]
    first, merged = contiguous_starts(n, (plo, po), (g, c))
    return Descriptors(
        region=np.concatenate([d.region[run], np.full(len(first), RemoteRegion.PACKED, dtype=np.int64)]),
        remote_off=np.concatenate([remote, po[first]]),
        local=np.concatenate([lo, plo[first]]),
        nbytes=np.concatenate([size, merged]),
        group=np.concatenate([direct_group, g[first]]),
        chunk=np.concatenate([np.full(len(run), -1, dtype=np.int64), c[first]]),
    )


@dataclass(frozen=True)
class ReadGroups:
    """What inference rank `rank` reads from each trainer rank, cut into pipeline groups in plan (layer) order."""

    reads: dict[int, Reads]  # by trainer rank: every rank it reads runs or fp8 rows from
    groups: dict[int, np.ndarray]  # by trainer rank: the group of each of its reads
    n_groups: int
    names: list[list[str]]  # the destination names each group completes, sorted
    stage_group: np.ndarray  # the group of each staging tensor this rank holds (fp8 plans), -1 for the others


def read_groups(plan: Plan, rank: int, group_bytes: int, quant: dict | None = None,
                reads: dict[int, Reads] | None = None) -> ReadGroups:
    """The reads of inference `rank` in `plan` (as it pulls them from the trainers; `reads` replaces them, e.g. with
    EPLB's mapped expert slots, runtime/tables/eplb.py) and their groups of about `group_bytes`. `quant` is its fp8
    READs as Reads-shaped rows (runtime/receiver/quant.py `grouping`): by ("quant", trainer rank), and ("stages",)
    for the staging tensors it holds, each under its fp8 weight entry."""
    reads = reads_of(plan, rank) if reads is None else reads
    trainers = sorted(set(reads) | {key[1] for key in quant or () if key[0] == "quant"})
    reads = {src: reads.get(src, _NO_READS) for src in trainers}
    groups = pipeline_groups({**reads, **(quant or {})}, group_bytes)
    n_groups = 1 + max((int(g.max()) for g in groups.values() if len(g)), default=0)
    mine = {src: groups[src] for src in trainers}
    names = [{plan.dests[int(d)].name for src, r in reads.items() for d in r.dest[mine[src] == g].tolist()}
             for g in range(n_groups)]
    stage_group = np.full(len(plan.staging), -1, dtype=np.int64)
    if quant is not None:
        held = np.flatnonzero(held_stages(plan, rank))
        stage_group[held] = groups[("stages",)]
        for stage in held.tolist():
            entry = plan.staging[stage]
            names[stage_group[stage]] |= {plan.dests[entry.weight].name, plan.dests[entry.scale].name}
    return ReadGroups(reads, mine, n_groups, [sorted(n) for n in names], stage_group)


@dataclass(frozen=True)
class ReadTables:
    """The READ descriptors inference rank posts to each trainer rank, and what it expects of that rank's packed region."""

    descriptors: dict[int, Descriptors]
    packed_bytes: dict[int, int]  # the size of each trainer rank's packed runs
    slot_bytes: dict[int, int]  # the size of the region serving them: all of them, or its ring
    table_bytes: int  # every table built for them, the trainers' packings included: none has a row dimension
    packed_read_bytes: int  # of the bytes read, those read from packed regions


def read_tables(plan: Plan, groups: ReadGroups, addresses: np.ndarray, ring_bytes: int,
                quant: dict[int, tuple[np.ndarray, ...]]) -> ReadTables:
    """The descriptors of `groups`' reads into destination entries at `addresses` (by entry), through rings of
    `ring_bytes` where the trainers' packed runs exceed it (ValueError if one packed run does not fit); `quant`:
    the fp8 READs by trainer rank as (region, remote offset, local address, bytes, group) columns."""
    packings = {src: packing(plan, src) for src in groups.reads}
    packed_at = {src: packings[src].offsets_of(r.run) for src, r in groups.reads.items()}
    rings = {src: ring_chunks(packings[src], ring_bytes) for src in groups.reads}
    descriptors = {}
    for src, reads in groups.reads.items():
        at, chunk, ring = packed_at[src], None, rings[src]
        if ring is not None:  # packed offsets count from the start of their chunk in the ring
            chunk = np.where(at >= 0, ring.chunk_of(np.maximum(at, 0)), -1)
            at = np.where(at >= 0, at - ring.start[np.maximum(chunk, 0)], -1)
        table = descriptor_table(reads, groups.groups[src], at, addresses[reads.dest] + reads.dst_byte, chunk)
        if src in quant:
            rows = (*quant[src], np.full(len(quant[src][0]), -1, dtype=np.int64))
            table = Descriptors(*(np.concatenate([getattr(table, f), q]) for f, q in zip(Descriptors.column_names(), rows)))
        descriptors[src] = table
    return ReadTables(
        descriptors,
        {src: p.nbytes for src, p in packings.items()},
        {src: p.nbytes if rings[src] is None else rings[src].slot_bytes for src, p in packings.items()},
        sum(r.footprint() + groups.groups[s].nbytes + descriptors[s].footprint() + packings[s].footprint()
            + packed_at[s].nbytes for s, r in groups.reads.items()),
        sum(int(r.total()[packed_at[s] >= 0].sum()) for s, r in groups.reads.items()),
    )


def runs_into(plan: Plan, rank: int, entries) -> dict[int, Reads]:
    """Inference `rank`'s reads of the plan's runs into `entries`, by trainer rank (as if it pulled them itself)."""
    wanted = np.zeros(len(plan.dests) + 1, dtype=bool)
    wanted[list(entries)] = True
    return {src: r.take(np.flatnonzero(wanted[r.dest])) for src, r in reads_of(plan, rank).items() if wanted[r.dest].any()}
