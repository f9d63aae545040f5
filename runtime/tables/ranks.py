"""What one rank does in a plan: the regions a trainer rank serves and the reads an inference rank posts.

Pure functions of the plan (numpy, no NIXL), shared by the sender and the receiver so both sides
derive the same layout independently and can check each other's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from ..checks import check_rank
from ..errors import PlanMismatchError
from ..plan.columns import ColumnTable
from ..plan.format import Plan
from ..plan.schema import DTYPE_SIZES


@dataclass(frozen=True)
class ServedRegion:
    """A trainer rank's local shard of one source, exposed in one wire dtype.

    When the wire dtype is the source dtype the shard itself is exposed (zero copy); otherwise the
    sender casts the shard into a staging region of `nbytes`.
    """

    source: int
    chain: int
    numel: int
    wire_dtype: str
    staged: bool

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.wire_dtype]

    @property
    def key(self) -> str:
        return f"{self.source}:{self.chain}"


class RemoteRegion(enum.IntEnum):
    """A READ's remote region on a trainer rank when it is not one of the exposed source regions (index >= 0)."""

    PACKED = -1  # the small runs the sender packs into one region (`packing`)
    FP8 = -2  # the fp8 values it quantized (runtime/sender/quant.py)
    SCALES = -3  # their float32 scales
    STAGE_PACKED = -4  # the receiver-side stage copies it packs


def region_addresses(region: np.ndarray, exposed: list[int], special: dict[RemoteRegion, int]) -> np.ndarray:
    """The remote base address of each READ: exposed regions by index, the others by their RemoteRegion."""
    out = np.zeros(len(region), dtype=np.int64)
    plain = region >= 0
    out[plain] = np.asarray(exposed, dtype=np.int64)[region[plain]]
    for kind, address in special.items():
        out[region == kind] = address
    return out


# Runs shorter than this are gathered by the sender into one packed region, in destination order,
# so a receiver reads them with a few large descriptors: UCX pays several microseconds per
# descriptor on this path, whatever its size (benchmarks/bench_runtime.py, host overhead rows).
PACK_BELOW_BYTES = 64 << 10


@dataclass(frozen=True)
class Reads(ColumnTable):
    """One inference rank's reads from one trainer rank, one row per stored plan run, in plan order.

    A row stands for `count` equally long rows of bytes (a strided run), row i at src_byte + i*src_stride
    and dst_byte + i*dst_stride: tables stay proportional to stored runs, never to the rows they stand for.
    """

    run: np.ndarray  # index into plan.table (stored runs)
    region: np.ndarray  # index into that trainer rank's served regions
    src_byte: np.ndarray  # byte offset of the first row inside the region
    dest: np.ndarray  # index into plan.dests
    dst_byte: np.ndarray  # byte offset of the first row inside the destination tensor
    nbytes: np.ndarray  # bytes per row
    count: np.ndarray
    src_stride: np.ndarray  # bytes between rows
    dst_stride: np.ndarray

    def total(self) -> np.ndarray:
        """Bytes of each stored run, all its rows."""
        return self.nbytes * self.count

    def contiguous(self) -> np.ndarray:
        """Whether each run's rows continue each other on both sides (one byte range each side)."""
        return (self.count == 1) | ((self.src_stride == self.nbytes) & (self.dst_stride == self.nbytes))


def row_pieces(count: np.ndarray, nbytes: np.ndarray, whole: np.ndarray, *sides: tuple[np.ndarray, np.ndarray]):
    """The descriptors of stored runs: one per run where `whole` (its rows continue each other on every side),
    else one per row. Returns (run of each descriptor, its bytes, its start on each side given as (start, stride))."""
    pieces = np.where(whole, 1, count)
    run = np.repeat(np.arange(len(count)), pieces)
    index = np.arange(len(run)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    size = np.where(whole, nbytes * count, nbytes)[run]
    return run, size, [start[run] + index * stride[run] for start, stride in sides]


def contiguous_starts(nbytes: np.ndarray, ends: tuple[np.ndarray, ...], keys: tuple[np.ndarray, ...] = ()):
    """Join consecutive rows that continue each other on every side (`ends`: byte offsets or addresses) and
    share every key: returns (first row of each joined descriptor, its bytes)."""
    joins = np.ones(max(len(nbytes) - 1, 0), dtype=bool)  # row i + 1 continues row i
    for at in ends:
        joins &= at[1:] == at[:-1] + nbytes[:-1]
    for key in keys:
        joins &= key[1:] == key[:-1]
    first = np.flatnonzero(np.concatenate([[True], ~joins])) if len(nbytes) else np.zeros(0, dtype=np.int64)
    return first, (np.add.reduceat(nbytes, first) if len(first) else nbytes[:0])


def check_src_rank(plan: Plan, rank: int) -> None:
    check_rank(rank, plan.header.src_ranks, "trainer")


def check_dst_rank(plan: Plan, rank: int) -> int:
    return check_rank(rank, plan.header.dst_ranks, "inference")


def check_pool(plan: Plan, pool_ranks: int | None) -> int:
    """The inference ranks a job's trainers serve, `pool_ranks` (None: the plan's), once the plan can serve them.

    Ranks beyond the plan's are DP replicas that copy the layout of DP replica 0 (`layout_rank`). That holds only
    where every DP replica holds the same entries: not with expert parallelism (each DP rank its own experts), not with
    node-local fan-out (pullers fixed per node), and checked entry by entry. A pool is whole replicas of tp x pp ranks.
    """
    ranks = plan.header.dst_ranks
    if pool_ranks is None:
        return ranks
    if isinstance(pool_ranks, bool) or not isinstance(pool_ranks, int) or pool_ranks < ranks:
        raise PlanMismatchError(f"pool_ranks must be an int of at least the plan's {ranks} inference ranks, not "
                                f"{pool_ranks!r}")
    if pool_ranks == ranks:
        return ranks
    inference, width = plan.header.inference, _replica_ranks(plan)
    where = f"pool_ranks={pool_ranks}"
    if inference.ep:
        raise PlanMismatchError(f"{where}: expert parallel plans give each DP rank its own experts: a replica beyond the "
                                f"plan's {ranks} ranks needs a plan compiled for the new size")
    if plan.fanout is not None:
        raise PlanMismatchError(f"{where}: this plan has node-local fan-out (gpus-per-node={inference.gpus_per_node}), "
                                f"whose pullers are fixed per node: a replica beyond the plan's {ranks} ranks needs a "
                                "plan compiled without it")
    if pool_ranks % width:
        raise PlanMismatchError(f"{where} is not whole replicas of the plan's {width} ranks (tp={inference.tp} x "
                                f"pp={inference.pp or 1})")
    replicas = range(0, ranks, width)
    for entry in (*plan.dests, *plan.staging):
        held = set(entry.ranks)
        if held != {r % width + first for r in held for first in replicas}:
            raise PlanMismatchError(f"{where}: the plan's DP replicas do not hold identical entries ({entry.name!r} is on "
                                    f"inference ranks {sorted(held)} only), so a replica beyond its {ranks} ranks has "
                                    "no layout to copy")
    return pool_ranks


def layout_rank(plan: Plan, rank: int, pool_ranks: int | None = None) -> int:
    """The plan rank whose tables inference `rank` uses: itself within the plan's ranks; for a rank of the pool beyond
    them (`check_pool`), the rank at its place in DP replica 0, `rank % (tp * pp)`. PlanMismatchError for a rank
    outside the pool or a plan that cannot serve one."""
    pool = check_pool(plan, pool_ranks)
    if pool == plan.header.dst_ranks:
        return check_dst_rank(plan, rank)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < pool:
        raise PlanMismatchError(f"inference rank {rank!r} is not in the pool's {pool} inference ranks (0..{pool - 1}, "
                                "pool_ranks)")
    return _copied(plan, rank)


def pool_members(plan: Plan, plan_ranks, pool_ranks: int) -> tuple[int, ...]:
    """Every rank of a pool `check_pool` accepted whose layout rank is one of `plan_ranks`: those ranks and the pool's
    copies of them."""
    wanted = set(plan_ranks)
    copies = (r for r in range(plan.header.dst_ranks, pool_ranks) if _copied(plan, r) in wanted)
    return tuple(sorted(wanted.union(copies)))


def _copied(plan: Plan, rank: int) -> int:
    """The plan rank a rank of a checked pool copies (the mapping of `layout_rank`)."""
    return rank if rank < plan.header.dst_ranks else rank % _replica_ranks(plan)


def _replica_ranks(plan: Plan) -> int:
    """The ranks of one DP replica: tp x pp."""
    return plan.header.inference.tp * (plan.header.inference.pp or 1)


def served_regions(plan: Plan, rank: int) -> tuple[ServedRegion, ...]:
    """Every (source, wire chain) whose bytes some run reads from trainer `rank`, in a canonical order."""
    check_src_rank(plan, rank)
    table = plan.table
    mine = table["src_rank"] == rank
    pairs = sorted(set(zip(table["src"][mine].tolist(), table["wire"][mine].tolist())))
    regions = []
    for source, chain in pairs:
        entry = plan.sources[source]
        numel = int(np.prod(plan.local_shape(source, rank), dtype=np.int64))
        wire = plan.cast_chains[chain][-1]
        regions.append(ServedRegion(source, chain, numel, wire, staged=wire != entry.dtype or len(plan.cast_chains[chain]) > 2))
    return tuple(regions)


def held_entries(plan: Plan, rank: int) -> np.ndarray:
    """Boolean mask over plan.dests: the destination entries inference `rank` holds."""
    check_dst_rank(plan, rank)
    return np.array([rank in e.ranks for e in plan.dests], dtype=bool)


def readers(plan: Plan, rank: int) -> tuple[int, ...]:
    """The inference ranks that read from trainer `rank`: under EPLB every rank, if it serves an expert tensor (any
    rank's slot may come to hold the expert it serves; runtime/tables/eplb.py)."""
    check_src_rank(plan, rank)
    dests = set(plan.table["dest"][plan.table["src_rank"] == rank].tolist())
    eplb = plan.header.inference.eplb
    if eplb is not None and {plan.dests[d].name for d in dests} & set(eplb.tensors):
        return tuple(range(plan.header.dst_ranks))
    return tuple(sorted({r for d in dests for r in plan.dests[d].ranks}))


def _reads(plan: Plan, sel: np.ndarray, src_rank: int) -> Reads:
    width = len(plan.cast_chains) + 1
    regions = served_regions(plan, src_rank)
    region_keys = np.array([r.source * width + r.chain for r in regions], dtype=np.int64)  # sorted
    runs = plan.table
    size = plan.stored_itemsize()[sel]
    return Reads(
        run=np.flatnonzero(sel),
        region=np.searchsorted(region_keys, runs["src"][sel] * width + runs["wire"][sel]),
        src_byte=runs["src_off"][sel] * size,
        dest=runs["dest"][sel],
        dst_byte=runs["dst_off"][sel] * size,
        nbytes=runs["length"][sel] * size,
        count=runs["count"][sel],
        src_stride=runs["src_stride"][sel] * size,
        dst_stride=runs["dst_stride"][sel] * size,
    )


def reads_of(plan: Plan, rank: int) -> dict[int, Reads]:
    """Inference `rank`'s descriptors, grouped by the trainer rank they read from."""
    runs = plan.table
    mask = held_entries(plan, rank)[runs["dest"]]
    return {src: _reads(plan, mask & (runs["src_rank"] == src), src) for src in sorted(set(runs["src_rank"][mask].tolist()))}


def served_runs(plan: Plan, rank: int) -> Reads:
    """Every run trainer `rank` serves (into entries of any inference rank), in plan order."""
    check_src_rank(plan, rank)
    return _reads(plan, plan.table["src_rank"] == rank, rank)


@dataclass(frozen=True)
class Packing:
    """The stored runs a trainer rank gathers into its packed region, back to back in (destination, offset)
    order, each run's rows in order, so a receiver's descriptors merge where destinations continue each other.

    `shape` cuts that order into spans of consecutive runs of one shape (region, row bytes, count, source
    stride): the sender copies each span with one gather (runtime/sender/pack.py).
    """

    run: np.ndarray  # stored plan runs, in packed order
    packed_byte: np.ndarray  # offset of each in the packed region
    shape: np.ndarray  # first packed position of each span of one shape, then len(run)
    unit: int  # bytes per gathered element: the largest of 8, 4, 2, 1 dividing every offset, stride and length
    nbytes: int

    def offsets_of(self, runs: np.ndarray) -> np.ndarray:
        """packed_byte of each of these stored plan runs, -1 where one is not packed."""
        if not len(self.run):
            return np.full(len(runs), -1, dtype=np.int64)
        order = np.argsort(self.run)
        at = np.minimum(np.searchsorted(self.run[order], runs), len(order) - 1)
        return np.where(self.run[order][at] == runs, self.packed_byte[order][at], -1)

    def footprint(self) -> int:
        return int(self.run.nbytes + self.packed_byte.nbytes + self.shape.nbytes)


def packing(plan: Plan, rank: int) -> Packing:
    """Which of trainer `rank`'s stored runs are packed (rows under PACK_BELOW_BYTES) and where."""
    return packing_of(served_runs(plan, rank))


def packing_of(served: Reads) -> Packing:
    """The packing of these served runs (one trainer rank's, in plan order)."""
    small = served.take(np.flatnonzero(served.nbytes < PACK_BELOW_BYTES))
    stride = np.where(small.count > 1, small.src_stride, 0)
    keys = (small.region, small.nbytes, small.count, stride)
    order = np.lexsort((small.dst_byte, small.dest))
    size = small.total()[order]
    packed_byte = np.cumsum(size) - size
    changes = np.flatnonzero(np.any([np.diff(k[order]) != 0 for k in keys], axis=0)) + 1 if len(order) > 1 else []
    shape = np.concatenate([[0], changes, [len(order)]]).astype(np.int64) if len(order) else np.zeros(1, dtype=np.int64)
    spans = np.concatenate([small.nbytes, small.src_byte, stride])
    unit = next(u for u in (8, 4, 2, 1) if not np.any(spans % u))
    return Packing(small.run[order], packed_byte, shape, unit, int(size.sum()))


def pipeline_groups(reads: dict[int, Reads], group_bytes: int) -> dict[int, np.ndarray]:
    """Group number of each descriptor: consecutive destination entries cut every `group_bytes`.

    Groups follow plan (layer) order across all trainer ranks, so group k of every trainer rank
    completes the same destination entries and post-ops can run on group k while k+1 moves.
    """
    if group_bytes <= 0:
        raise ValueError(f"group_bytes must be positive, got {group_bytes}")
    if not reads:
        return {}
    dests = np.unique(np.concatenate([r.dest for r in reads.values()]))
    per_dest = np.zeros(int(dests.max()) + 1, dtype=np.int64)
    for r in reads.values():
        np.add.at(per_dest, r.dest, r.total())
    # An entry starts a new group when the bytes before it cross a multiple of group_bytes.
    before = np.cumsum(per_dest[dests]) - per_dest[dests]
    group_of = np.zeros_like(per_dest)
    group_of[dests] = before // group_bytes
    _, dense = np.unique(group_of[dests], return_inverse=True)
    group_of[dests] = dense
    return {src: group_of[r.dest] for src, r in reads.items()}
