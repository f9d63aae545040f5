"""The plan file format: deterministic writer, validating reader, fingerprint (rules in invariants.py).

Layout (all integers little-endian):

    magic       8 bytes   b"WPLAN\\x00\\r\\n"
    header_len  u64
    header      canonical JSON (sorted keys, no spaces), UTF-8: header.PlanHeader.to_json(); a plan with constant
                writes lists them under "constants" (format 5; a plan without them is format 4); a plan with
                node-local fan-out has "fanout" (format 6, see schema.Fanout)
    payload     zlib stream of int64 columns: the runs (RUN_COLUMNS, n_runs each; a run with count > 1
                stands for `count` rows, row i at src_off + i*src_stride and dst_off + i*dst_stride), then the stage runs
                (STAGE_COLUMNS, n_stage_runs each), then the block spans (SPAN_COLUMNS, n_spans each)
    digest      32 bytes  SHA-256 of everything before it

Reading never unpickles or evaluates anything: JSON plus numpy.frombuffer of int64 columns.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import zlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import PlanFormatError
from ..files import MAX_PLAN_BYTES, read_regular_file
from ..layout.placements import Box
from ..layout.shards import ShardLayout
from ..files import write_atomically
from .columns import BlockSpans, Runs, StageRuns
from .coverage import check_coverage
from .header import MAX_ELEMENTS, PlanHeader, canonical_json, fingerprint
from .invariants import check_constants, check_fanout, check_quant_tables, check_runs
from .schema import DTYPE_SIZES, RUN_COLUMNS, SPAN_COLUMNS, STAGE_COLUMNS, TensorEntry

MAGIC = b"WPLAN\x00\r\n"
# Columns a payload may inflate to: deflate could expand about 1032:1, the plans compile-plan writes stay below 200:1
# (GLM-5.2's MTP plan: 172), so the reader never allocates more than this multiple of the file for its columns.
MAX_EXPANSION = 512


def _from_header(name: str) -> property:
    """A read-only Plan attribute that is the header's field `name`."""
    return property(lambda plan: getattr(plan.header, name), doc=f"The header's `{name}`.")


@dataclass(frozen=True)
class Plan:
    """A loaded plan: its header (the tensor tables among it) and run columns (elements, not bytes).

    `table` holds the runs as stored (strided runs included); `runs` the same runs as contiguous
    one-row runs, which is what executors move. `stage` and `spans` are the fp8 tables.
    """

    header: PlanHeader
    table: Runs = field(repr=False)
    stage: StageRuns = field(default_factory=StageRuns.empty, repr=False)
    spans: BlockSpans = field(default_factory=BlockSpans.empty, repr=False)

    # The tensor tables and the fingerprint live in the header (typed there); a plan reads them through.
    sources = _from_header("sources")
    dests = _from_header("dests")
    cast_chains = _from_header("cast_chains")
    staging = _from_header("staging")
    constants = _from_header("constants")
    derived = _from_header("derived")
    fanout = _from_header("fanout")
    fingerprint = _from_header("fingerprint")

    @property
    def unloaded(self) -> tuple[TensorEntry, ...]:
        """Parameters vLLM's load_weights never writes (header `inference.unloaded`): the plan leaves them alone."""
        return self.header.inference.unloaded

    @cached_property
    def pulling(self) -> "Plan":
        """The plan as the trainers serve it: each destination and staging entry held by the ranks that pull it from
        the trainers (with fan-out, one per node; the others read it from their node's puller). Without fan-out, itself."""
        if self.fanout is None:
            return self
        pullers = self.fanout.pullers()
        dests = tuple(dataclasses.replace(e, ranks=pullers.get(i, e.ranks)) for i, e in enumerate(self.dests))
        staging = tuple(dataclasses.replace(e, ranks=pullers.get(e.weight, e.ranks)) for e in self.staging)
        return dataclasses.replace(self, header=dataclasses.replace(self.header, dests=dests, staging=staging, fanout=None))

    @cached_property
    def shard_layout(self) -> ShardLayout:
        """The box of each source every trainer rank holds (see runtime/layout/shards.py)."""
        return ShardLayout.from_header(self.header.trainer, [(e.name, e.box_class) for e in self.sources])

    def shard_box(self, source: int, rank: int) -> Box | None:
        """The box of source `source` that trainer `rank` holds; None if the rank is not in its mesh."""
        return self.shard_layout.box(source, rank)

    def local_shape(self, source: int, rank: int) -> tuple[int, ...]:
        """Shape of trainer `rank`'s local shard of source `source`; (0,) off its mesh, as DTensor reports."""
        box = self.shard_box(source, rank)
        return (0,) if box is None else tuple(b - a for a, b in box)

    @cached_property
    def runs(self) -> Runs:
        """Every row of every run, in stored order (rows of a strided run consecutive), as plain runs."""
        return self.table.expand()

    @property
    def n_runs(self) -> int:
        """Rows (contiguous runs) in the plan; `n_stored_runs` counts table entries."""
        return int(self.table["count"].sum())

    @property
    def n_stored_runs(self) -> int:
        return int(self.table["count"].shape[0])

    def wire_itemsize(self) -> np.ndarray:
        """Bytes per element on the wire (the destination dtype) for each row of `runs`."""
        return self._sizes()[self.runs["wire"]]

    def stored_itemsize(self) -> np.ndarray:
        """Bytes per element on the wire for each entry of `table`."""
        return self._sizes()[self.table["wire"]]

    def _sizes(self) -> np.ndarray:
        return np.array([DTYPE_SIZES[chain[-1]] for chain in self.cast_chains] or [0], dtype=np.int64)


def encode_plan(header: PlanHeader, runs: dict[str, np.ndarray], stage: StageRuns | None = None,
                spans: BlockSpans | None = None) -> bytes:
    """Serialize deterministically: the header sealed with its column counts and fingerprint, then the columns."""
    stage, spans = stage or StageRuns.empty(), spans or BlockSpans.empty()
    counts = []
    for table, names in ((runs, RUN_COLUMNS), (stage, STAGE_COLUMNS), (spans, SPAN_COLUMNS)):
        n = {len(table[c]) for c in names}
        if len(n) != 1:
            raise ValueError(f"columns {names} differ in length: {n}")
        counts.append(n.pop())
    columns = b"".join(np.ascontiguousarray(table[c], dtype="<i8").tobytes()
                       for table, names in ((runs, RUN_COLUMNS), (stage, STAGE_COLUMNS), (spans, SPAN_COLUMNS))
                       for c in names)
    payload = zlib.compress(columns, 6)
    head = canonical_json(header.sealed(*counts).to_json())
    body = MAGIC + struct.pack("<Q", len(head)) + head + payload
    return body + hashlib.sha256(body).digest()


def write_plan(path: str | Path, header: PlanHeader, runs: dict[str, np.ndarray], stage: StageRuns | None = None,
               spans: BlockSpans | None = None) -> Path:
    """Write atomically (runtime/files.py): a reader never sees part of a plan; one PlanFormatError line on failure."""
    return write_atomically(path, encode_plan(header, runs, stage, spans), PlanFormatError, "plan")


def decode_plan(data: bytes, origin: str = "<bytes>") -> Plan:
    if len(data) < len(MAGIC) + 8 + 32 or not data.startswith(MAGIC):
        raise PlanFormatError(f"{origin} is not a weightplan plan file (bad magic or too short)")
    body, digest = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise PlanFormatError(f"{origin} is truncated or corrupted (checksum mismatch); recompile it with compile-plan")
    (head_len,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    if head_len > len(body) - start:
        raise PlanFormatError(f"{origin}: header length {head_len} runs past the end of the file")
    try:
        obj = json.loads(body[start : start + head_len].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise PlanFormatError(f"{origin} has an unreadable header: {str(exc)[:200]}") from None
    header = PlanHeader.from_json(obj, origin)
    if fingerprint(header.to_json()) != header.fingerprint:
        raise PlanFormatError(f"{origin}: header fingerprint does not match its contents")
    n, n_stage, n_spans = header.n_runs, header.n_stage_runs, header.n_spans
    expected = 8 * (n * len(RUN_COLUMNS) + n_stage * len(STAGE_COLUMNS) + n_spans * len(SPAN_COLUMNS))
    payload = body[start + head_len :]
    if expected > MAX_EXPANSION * len(payload) + 64:
        raise PlanFormatError(f"{origin}: the header declares {expected} bytes of columns, more than {MAX_EXPANSION} times "
                              f"its {len(payload)}-byte payload (plans compile-plan writes stay below 200 times)")
    try:
        inflate = zlib.decompressobj()
        columns = inflate.decompress(payload, max(expected, 1))  # never more than the declared size (0 means unbounded)
        extra = inflate.unconsumed_tail or inflate.decompress(b"", 1) or not inflate.eof
    except zlib.error as exc:
        raise PlanFormatError(f"{origin} has a corrupted payload: {exc}") from None
    if len(columns) != expected or extra:
        raise PlanFormatError(f"{origin}: payload does not hold the {expected} bytes of columns its header declares")
    flat = np.frombuffer(columns, dtype="<i8").astype(np.int64)
    tables, at = [], 0
    for count, names in ((n, RUN_COLUMNS), (n_stage, STAGE_COLUMNS), (n_spans, SPAN_COLUMNS)):
        tables.append({c: flat[at + i * count : at + (i + 1) * count] for i, c in enumerate(names)})
        at += count * len(names)
    for table in tables:
        for column, values in table.items():
            # -1 marks "no trainer rank" (receiver side); every other value is an index, offset, length or stride
            if len(values) and (values.min() < -1 or values.max() >= MAX_ELEMENTS):
                raise PlanFormatError(f"{origin}: column {column!r} holds {int(values.min())}..{int(values.max())}, "
                                      "outside -1..2**48")
    plan = Plan(header, *(kind.from_columns(table) for kind, table in zip((Runs, StageRuns, BlockSpans), tables)))
    check_runs(plan, origin)
    check_quant_tables(plan, origin)
    check_constants(plan, origin)
    check_fanout(plan, origin)
    check_coverage(plan, origin)
    return plan


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file; raises PlanFormatError with the reason on any defect."""
    if "\0" in str(path):
        raise PlanFormatError(f"plan path {str(path)[:80]!r} holds a NUL byte")
    return decode_plan(read_regular_file(path, MAX_PLAN_BYTES, PlanFormatError, "plan"), str(path))
