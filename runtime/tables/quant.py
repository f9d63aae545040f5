"""Pure fp8 tables of a plan (block pieces, bf16 windows, stage copies) that the sender and receiver derive alike."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..errors import PlanMismatchError
from ..fp8.numerics import BLOCK, block_grid
from ..plan.columns import ColumnTable
from ..plan.format import Plan
from ..plan.schema import GATHER, RECEIVER
from .ranks import PACK_BELOW_BYTES, ServedRegion, check_dst_rank, check_src_rank, served_regions



@dataclass(frozen=True)
class Pieces(ColumnTable):
    """Rectangles of whole blocks quantized with one call each, in span order.

    A staging tensor is seen as 2-D (matrices * rows, cols). A piece covers rows [row, row + height),
    columns [col, col + width) and blocks [first_block, first_block + n_blocks), whose scales are
    row-major (ceil(height / 128), ceil(width / 128)). Pieces a trainer quantizes (sender and gather
    sides) have their fp8 bytes at `fp8_off` (height * width, row-major) and scales at `scale_off` in
    the quantizing rank's regions.
    """

    stage: np.ndarray
    side: np.ndarray
    src_rank: np.ndarray  # quantizing trainer rank; -1 on the receiver side
    row: np.ndarray
    col: np.ndarray
    height: np.ndarray
    width: np.ndarray
    pitch: np.ndarray  # columns of the staging tensor
    first_block: np.ndarray
    n_blocks: np.ndarray
    window: np.ndarray  # index into Windows
    fp8_off: np.ndarray  # -1 on the receiver side
    scale_off: np.ndarray


@dataclass(frozen=True)
class Windows(ColumnTable):
    """Runs of consecutive block rows of one staging tensor that one side holds in bf16: flat elements [lo, hi).

    `covered`: stage copies write every element, so the buffer needs no zeroing for the padding.
    """

    stage: np.ndarray
    side: np.ndarray
    src_rank: np.ndarray  # the trainer rank quantizing the window; -1 on the receiver side
    lo: np.ndarray
    hi: np.ndarray
    covered: np.ndarray

    @property
    def numel(self) -> np.ndarray:
        return self.hi - self.lo


@dataclass(frozen=True)
class StageCopies(ColumnTable):
    """Stage runs cut to the windows they feed: `length` elements of the shard at `src_off` to `win_off` in `window`.

    Elements outside every window of their side are never needed, so they are never copied or read.
    `quant_rank` copies it into its window (on the gather side, from peer `src_rank` when they differ).
    """

    side: np.ndarray
    src_rank: np.ndarray
    quant_rank: np.ndarray
    src: np.ndarray
    wire: np.ndarray
    src_off: np.ndarray
    stage: np.ndarray
    window: np.ndarray
    win_off: np.ndarray
    length: np.ndarray


@dataclass(frozen=True)
class QuantTables:
    """Everything both sides need about a plan's fp8 part; compute once per plan with `quant_tables`."""

    pieces: Pieces
    windows: Windows
    copies: StageCopies

    def sender_pieces(self, rank: int) -> Pieces:
        """The pieces trainer `rank` quantizes and serves (sender and gather sides)."""
        p = self.pieces
        return p.take(np.flatnonzero((p.side != RECEIVER) & (p.src_rank == rank)))

    def gathered(self, rank: int) -> np.ndarray:
        """Rows of `copies` trainer `rank` reads from its peers at every publish (gather side)."""
        c = self.copies
        return np.flatnonzero((c.side == GATHER) & (c.quant_rank == rank) & (c.src_rank != rank))

    def gatherers(self, rank: int) -> tuple[int, ...]:
        """The trainer ranks that read bf16 from trainer `rank` at every publish."""
        c = self.copies
        return tuple(sorted(set(c.quant_rank[(c.side == GATHER) & (c.src_rank == rank) & (c.quant_rank != rank)].tolist())))

    def region_bytes(self, rank: int) -> tuple[int, int]:
        """(fp8 bytes, scale count) of trainer `rank`'s quantized regions."""
        mine = self.sender_pieces(rank)
        return int((mine.height * mine.width).sum()), int(mine.n_blocks.sum())


def check_supported(plan: Plan) -> None:
    """Refuse fp8 tables the runtime cannot execute, before anything is registered."""
    layout = plan.header.quant_layout
    if layout is not None and (layout.layout != "plain" or layout.block != (BLOCK, BLOCK)):
        raise PlanMismatchError(f"the plan targets the {layout.layout!r} fp8 layout with blocks {list(layout.block)}: "
                                f"the NIXL runtime executes only the plain layout with {BLOCK}x{BLOCK} blocks")
    for entry in plan.staging:
        weight, scale = plan.dests[entry.weight], plan.dests[entry.scale]
        if entry.dtype != "bfloat16" or weight.dtype != "float8_e4m3fn" or scale.dtype != "float32" or len(entry.shape) not in (2, 3):
            raise PlanMismatchError(f"staging tensor {entry.name!r} is {entry.dtype}{list(entry.shape)} quantized into "
                                    f"{weight.dtype} + {scale.dtype} scales: the NIXL runtime executes 2-D/3-D bfloat16 "
                                    "staging into float8_e4m3fn values and float32 scales only")
    ends = {plan.cast_chains[w][-1] for w in set(plan.stage["wire"].tolist())}
    if ends - {"bfloat16"}:
        raise PlanMismatchError(f"stage runs end in {sorted(ends)}, the NIXL runtime stages bfloat16 only")


def quant_tables(plan: Plan) -> QuantTables:
    """Cut every block span into pieces, group each side's pieces into windows, and cut stage runs to those windows."""
    pieces, windows = _pieces_and_windows(plan)
    copies = _copies(plan, windows)
    covered = np.bincount(copies.window, weights=copies.length, minlength=len(windows)).astype(np.int64) == windows.numel
    return QuantTables(pieces, dataclasses.replace(windows, covered=covered), copies)


def _geometry(shape):
    rows, cols = shape[-2:]
    _, nbr, nbc = block_grid(shape)

    def band_rows(band: int) -> tuple[int, int]:
        base = band // nbr * rows + band % nbr * BLOCK
        return base, base + min(BLOCK, rows - band % nbr * BLOCK)

    return rows, cols, nbr, nbc, band_rows


def _span_pieces(shape, first: int, count: int):
    """(row, col, height, width, first block, blocks, first band, end band) of one span, in block order."""
    rows, cols, nbr, nbc, band_rows = _geometry(shape)
    out, b, end = [], first, first + count
    while b < end:
        band, c = divmod(b, nbc)
        if c or end - b < nbc:  # part of one block row
            take = min(nbc - c, end - b)
            r0, r1 = band_rows(band)
            out.append((r0, c * BLOCK, r1 - r0, min(cols, (c + take) * BLOCK) - c * BLOCK, b, take, band, band + 1))
            b += take
            continue
        last = end // nbc  # whole block rows up to here; a short last block row ends its matrix's tiles
        if rows % BLOCK:
            last = min(last, (band // nbr + 1) * nbr)
        r0, r1 = band_rows(band)[0], band_rows(last - 1)[1]
        out.append((r0, 0, r1 - r0, cols, b, (last - band) * nbc, band, last))
        b = last * nbc
    return out


def _pieces_and_windows(plan: Plan) -> tuple[Pieces, Windows]:
    spans = plan.spans
    rows, wins = [], []
    owner_of = {}
    order = np.lexsort((spans["first_block"], spans["src_rank"], spans["side"], spans["stage"]))
    for i in order.tolist():
        stage, side, rank = int(spans["stage"][i]), int(spans["side"][i]), int(spans["src_rank"][i])
        shape = plan.staging[stage].shape
        key = (stage, side, rank if side != RECEIVER else -1)
        for piece in _span_pieces(shape, int(spans["first_block"][i]), int(spans["n_blocks"][i])):
            band_lo, band_hi = piece[6], piece[7]
            last = owner_of.get(key)
            if last is None or band_lo > wins[last][4]:  # a new run of block rows
                owner_of[key] = last = len(wins)
                wins.append([stage, side, key[2], band_lo, band_hi])
            wins[last][4] = max(wins[last][4], band_hi)  # pieces of one block row share it
            rows.append((stage, side, key[2], *piece[:4], shape[-1], piece[4], piece[5], last))
    cols = np.array(rows, dtype=np.int64).reshape(-1, 11).T
    w = np.array(wins, dtype=np.int64).reshape(-1, 5).T
    lo, hi = np.zeros(w.shape[1], dtype=np.int64), np.zeros(w.shape[1], dtype=np.int64)
    for j, (stage, band_lo, band_hi) in enumerate(zip(w[0].tolist(), w[3].tolist(), w[4].tolist())):
        shape = plan.staging[stage].shape
        _, cols_, _, _, band_rows = _geometry(shape)
        lo[j], hi[j] = band_rows(band_lo)[0] * cols_, band_rows(band_hi - 1)[1] * cols_
    size = cols[5] * cols[6]
    fp8_off, scale_off = np.full(len(size), -1, dtype=np.int64), np.full(len(size), -1, dtype=np.int64)
    sender = cols[1] != RECEIVER  # one fp8 and one scale region per trainer rank, for both of its sides
    for rank in np.unique(cols[2][sender]).tolist():
        mine = np.flatnonzero(sender & (cols[2] == rank))
        fp8_off[mine] = np.cumsum(size[mine]) - size[mine]
        scale_off[mine] = np.cumsum(cols[9][mine]) - cols[9][mine]
    pieces = Pieces(stage=cols[0], side=cols[1], src_rank=cols[2], row=cols[3], col=cols[4], height=cols[5], width=cols[6],
                    pitch=cols[7], first_block=cols[8], n_blocks=cols[9], window=cols[10], fp8_off=fp8_off, scale_off=scale_off)
    windows = Windows(stage=w[0], side=w[1], src_rank=w[2], lo=lo, hi=hi, covered=np.zeros(w.shape[1], dtype=bool))
    return pieces, windows


def _copies(plan: Plan, windows: Windows) -> StageCopies:
    """Intersect every stage run with the windows of its side (and, on the sender side, of its rank)."""
    t = plan.stage
    numel = max([e.numel for e in plan.staging] + [1]) + 1
    owners = plan.header.src_ranks + 1

    def key(stage, side, owner):
        return ((stage * 3 + side) * owners + owner + 1) * numel  # sides 0, 1, 2

    run_owner = np.where(t["side"] == RECEIVER, -1, t["quant_rank"])
    run_key = key(t["stage"], t["side"], run_owner)
    win_key = key(windows.stage, windows.side, windows.src_rank)
    order = np.argsort(win_key + windows.lo, kind="stable")
    w_lo, w_hi = (win_key + windows.lo)[order], (win_key + windows.hi)[order]
    a, b = run_key + t["stage_off"], run_key + t["stage_off"] + t["length"]
    first = np.searchsorted(w_hi, a, side="right")
    count = np.maximum(np.searchsorted(w_lo, b, side="left") - first, 0)
    run = np.repeat(np.arange(len(a)), count)
    at = np.repeat(first - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))
    lo = np.maximum(a[run], w_lo[at])
    hi = np.minimum(b[run], w_hi[at])
    window = order[at]
    return StageCopies(side=t["side"][run], src_rank=t["src_rank"][run], quant_rank=t["quant_rank"][run],
                       src=t["src"][run], wire=t["wire"][run],
                       src_off=t["src_off"][run] + lo - a[run], stage=t["stage"][run], window=window,
                       win_off=lo - w_lo[at], length=hi - lo)


def _region(plan: Plan, rank: int, source: int, chain: int) -> ServedRegion:
    """A source shard exposed in a wire dtype, staged by the same rule as rank_tables.served_regions."""
    entry = plan.sources[source]
    numel = int(np.prod(plan.local_shape(source, rank), dtype=np.int64))
    wire = plan.cast_chains[chain][-1]
    return ServedRegion(source, chain, numel, wire, staged=wire != entry.dtype or len(plan.cast_chains[chain]) > 2)


def exposed_regions(plan: Plan, tables: QuantTables | None, rank: int) -> tuple[ServedRegion, ...]:
    """served_regions, then the (source, chain) pairs only receiver-side stage copies or gathering peers read, in a canonical order."""
    served = served_regions(plan, rank)
    if tables is None:
        return served
    c = tables.copies
    mine = (c.src_rank == rank) & ((c.side == RECEIVER) | ((c.side == GATHER) & (c.quant_rank != rank)))
    have = {(r.source, r.chain) for r in served}
    extra = sorted(set(zip(c.src[mine].tolist(), c.wire[mine].tolist())) - have)
    return served + tuple(_region(plan, rank, s, w) for s, w in extra)


def region_index(regions: tuple[ServedRegion, ...], copies: StageCopies) -> np.ndarray:
    """Index into `regions` of every copy's (source, chain)."""
    index = {(r.source, r.chain): i for i, r in enumerate(regions)}
    return np.array([index[k] for k in zip(copies.src.tolist(), copies.wire.tolist())], dtype=np.int64)


def served_copies(tables: QuantTables, rank: int) -> np.ndarray:
    """Rows of tables.copies that receivers read from trainer `rank`, in canonical (plan) order."""
    c = tables.copies
    return np.flatnonzero((c.side == RECEIVER) & (c.src_rank == rank))


@dataclass(frozen=True)
class StagePacking:
    """Receiver-side stage copies a trainer rank gathers into its packed stage region, by (stage, window, offset)."""

    copy: np.ndarray  # rows of tables.copies, in packed order
    packed_byte: np.ndarray
    unit: int
    nbytes: int

    def offsets_by_copy(self, n_copies: int) -> np.ndarray:
        out = np.full(n_copies, -1, dtype=np.int64)
        out[self.copy] = self.packed_byte
        return out


def stage_packing(plan: Plan, tables: QuantTables, rank: int) -> StagePacking:
    """Which of trainer `rank`'s receiver-side stage copies are packed (under PACK_BELOW_BYTES) and where."""
    check_src_rank(plan, rank)
    c = tables.copies
    mine = served_copies(tables, rank)
    size = c.length[mine] * 2
    small = mine[size < PACK_BELOW_BYTES]
    copy = small[np.lexsort((c.win_off[small], c.window[small], c.stage[small]))]
    size = c.length[copy] * 2
    src_byte = c.src_off[copy] * 2
    unit = next(u for u in (8, 4, 2) if not (np.any(size % u) or np.any(src_byte % u)))
    return StagePacking(copy, np.cumsum(size) - size, unit, int(size.sum()))


def held_stages(plan: Plan, rank: int) -> np.ndarray:
    """Boolean mask over plan.staging: the staging tensors inference `rank` holds."""
    check_dst_rank(plan, rank)
    return np.array([rank in e.ranks for e in plan.staging] + [False], dtype=bool)[:-1]


def quant_readers(plan: Plan, tables: QuantTables, rank: int) -> tuple[int, ...]:
    """The inference ranks that read fp8 bytes, scales or bf16 stage copies from trainer `rank`."""
    c, p = tables.copies, tables.pieces
    stages = set(c.stage[(c.side == RECEIVER) & (c.src_rank == rank)].tolist())
    stages |= set(p.stage[(p.side != RECEIVER) & (p.src_rank == rank)].tolist())
    return tuple(sorted({k for s in stages for k in plan.staging[s].ranks}))


def quant_sources(plan: Plan, tables: QuantTables, rank: int) -> tuple[int, ...]:
    """The trainer ranks inference `rank` reads fp8 bytes, scales or bf16 stage copies from."""
    held = held_stages(plan, rank)
    c, p = tables.copies, tables.pieces
    ranks = set(c.src_rank[(c.side == RECEIVER) & held[c.stage]].tolist())
    ranks |= set(p.src_rank[(p.side != RECEIVER) & held[p.stage]].tolist())
    return tuple(sorted(ranks))


def piece_segments(pieces: Pieces) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Destination element segments of each piece in destination order: (piece row, dest offset, offset in piece, length).

    A piece spanning whole rows of its tensor is one segment; otherwise one per row.
    """
    whole = pieces.width == pieces.pitch
    n = np.where(whole, 1, pieces.height)
    piece = np.repeat(np.arange(len(pieces)), n)
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # row within the piece (0 for whole pieces)
    start = pieces.row[piece] * pieces.pitch[piece] + pieces.col[piece]
    length = np.where(whole[piece], pieces.height[piece] * pieces.width[piece], pieces.width[piece])
    return piece, start + k * pieces.pitch[piece], k * pieces.width[piece], length
