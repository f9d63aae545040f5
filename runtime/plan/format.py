"""The plan file format: schema, deterministic writer, validating reader, fingerprint.

Layout (all integers little-endian):

    magic       8 bytes   b"WPLAN\\x00\\r\\n"
    header_len  u64
    header      canonical JSON (sorted keys, no spaces), UTF-8; a plan with constant writes lists them under
                "constants" as [dest, dst_off, length, value] rows (format 5; a plan without them is format 4)
    payload     zlib stream of int64 columns: the runs (RUN_COLUMNS, n_runs each; a run with count > 1
                stands for `count` rows, row i at src_off + i*src_stride and dst_off + i*dst_stride), then the stage runs
                (STAGE_COLUMNS, n_stage_runs each), then the block spans (SPAN_COLUMNS, n_spans each)
    digest      32 bytes  SHA-256 of everything before it

Reading never unpickles or evaluates anything: JSON plus numpy.frombuffer of int64 columns.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import zlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from .atomic_file import write_atomically
from ..errors import PlanFormatError
from .header import MAX_ELEMENTS, check_header
from ..layout.placements import Box
from ..layout.shards import ShardLayout

MAGIC = b"WPLAN\x00\r\n"
_ZLIB_MAX_RATIO = 1032  # deflate expands at most about 1032:1
FORMAT_VERSION = 5  # the newest format this reads: 5 adds the constants table
BASE_FORMAT_VERSION = 4  # plans without constants are written as format 4, which readers of format 4 read alike
CONSTANT_COLUMNS = ("dest", "dst_off", "length", "value")
ROW_COLUMNS = ("src_rank", "src", "src_off", "dest", "dst_off", "length", "wire")
RUN_COLUMNS = ROW_COLUMNS + ("count", "src_stride", "dst_stride")
# fp8_per_block: bf16 runs from trainer rank src_rank's shard into a staging tensor, and spans of
# 128x128 blocks quantized on one side. Side 0 (sender): trainer src_rank quantizes blocks only it
# holds, from its own shard. Side 1 (receiver): every inference rank holding the tensor pulls the
# bf16 and quantizes. Side 2 (gather): trainer quant_rank reads the bf16 of blocks several trainer
# ranks hold from its peers once, quantizes them and serves fp8 to every holder. A stage run's
# quant_rank is the trainer rank that copies it (src_rank on side 0, -1 on side 1); a span's
# src_rank is its quantizing trainer rank (-1 on side 1).
STAGE_COLUMNS = ("side", "src_rank", "quant_rank", "src", "src_off", "stage", "stage_off", "length", "wire")
SPAN_COLUMNS = ("stage", "first_block", "n_blocks", "side", "src_rank")
SENDER, RECEIVER, GATHER = 0, 1, 2
TRAINER_SIDES = (SENDER, GATHER)  # blocks a trainer rank quantizes and serves as fp8
# Header keys that the fingerprint covers: everything the plan assumes about both sides.
FINGERPRINT_KEYS = (
    "format_version",
    "vllm_version",
    "model",
    "config_sha256",
    "trainer",
    "inference",
    "quant",
    "sources",
    "dests",
    "cast_chains",
    "staging",
    "quant_layout",
    "derived",
)
OPTIONAL_FINGERPRINT_KEYS = ("constants",)  # covered when present; absent keys keep older plans' fingerprints
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int8": 1,
               "uint8": 1, "float8_e4m3fn": 1, "bool": 1}


@dataclass(frozen=True)
class TensorEntry:
    """A trainer tensor (with its index into the header's trainer layouts) or a destination entry
    (with the inference ranks holding it)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: int = 0
    ranks: tuple[int, ...] = (0,)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class StagingEntry:
    """A bf16 tensor vLLM's loaders write and process_weights_after_loading quantizes into dests weight + scale."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    ranks: tuple[int, ...]
    weight: int
    scale: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class ConstantRun:
    """Elements [dst_off, dst_off + length) of destination entry `dest` hold `value` (cast to its dtype); never on the wire."""

    dest: int
    dst_off: int
    length: int
    value: float | int | bool


@dataclass(frozen=True)
class Plan:
    """A loaded plan: header fields, tensor tables and run columns (elements, not bytes).

    `table` holds the runs as stored (RUN_COLUMNS, strided runs included); `runs` the same runs
    as contiguous rows (ROW_COLUMNS), which is what executors move.
    """

    header: dict
    sources: tuple[TensorEntry, ...]
    dests: tuple[TensorEntry, ...]
    cast_chains: tuple[tuple[str, ...], ...]
    table: dict[str, np.ndarray] = field(repr=False)
    staging: tuple[StagingEntry, ...] = ()
    stage: dict[str, np.ndarray] = field(default_factory=lambda: _empty(STAGE_COLUMNS), repr=False)
    spans: dict[str, np.ndarray] = field(default_factory=lambda: _empty(SPAN_COLUMNS), repr=False)
    constants: tuple[ConstantRun, ...] = ()

    @property
    def fingerprint(self) -> str:
        return self.header["fingerprint"]

    @cached_property
    def trainer_layout(self) -> ShardLayout:
        """The box of each source every trainer rank holds (see runtime/layout/shards.py)."""
        return ShardLayout.from_header(self.header["trainer"], [(e.name, e.layout) for e in self.sources])

    def shard_box(self, source: int, rank: int) -> Box | None:
        """The box of source `source` that trainer `rank` holds; None if the rank is not in its mesh."""
        return self.trainer_layout.box(source, rank)

    def local_shape(self, source: int, rank: int) -> tuple[int, ...]:
        """Shape of trainer `rank`'s local shard of source `source`; (0,) off its mesh, as DTensor reports."""
        box = self.shard_box(source, rank)
        return (0,) if box is None else tuple(b - a for a, b in box)

    @cached_property
    def runs(self) -> dict[str, np.ndarray]:
        """Every row of every run, in stored order (rows of a strided run consecutive), as plain columns."""
        t = self.table
        count = t["count"]
        run = np.repeat(np.arange(len(count)), count)
        step = np.arange(len(run)) - np.repeat(np.cumsum(count) - count, count)
        rows = {c: t[c][run] for c in ROW_COLUMNS}
        rows["src_off"] = rows["src_off"] + step * t["src_stride"][run]
        rows["dst_off"] = rows["dst_off"] + step * t["dst_stride"][run]
        return rows

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


def fingerprint(header: dict) -> str:
    subset = {key: header[key] for key in FINGERPRINT_KEYS}
    subset.update({key: header[key] for key in OPTIONAL_FINGERPRINT_KEYS if key in header})
    return hashlib.sha256(_canonical(subset)).hexdigest()


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _empty(columns) -> dict[str, np.ndarray]:
    return {c: np.zeros(0, dtype=np.int64) for c in columns}


def encode_plan(header: dict, runs: dict[str, np.ndarray], stage: dict | None = None, spans: dict | None = None) -> bytes:
    """Serialize deterministically; `header` must hold the FINGERPRINT_KEYS fields (quant tables default to empty)."""
    stage, spans = stage or _empty(STAGE_COLUMNS), spans or _empty(SPAN_COLUMNS)
    counts = []
    for table, names in ((runs, RUN_COLUMNS), (stage, STAGE_COLUMNS), (spans, SPAN_COLUMNS)):
        n = {len(table[c]) for c in names}
        if len(n) != 1:
            raise ValueError(f"columns {names} differ in length: {n}")
        counts.append(n.pop())
    header = {"staging": [], "quant_layout": {}, "derived": [], **header}
    if "constants" in header and not header["constants"]:
        del header["constants"]
    version = FORMAT_VERSION if "constants" in header else BASE_FORMAT_VERSION
    header = dict(header, format_version=version, kind="weightplan", n_runs=counts[0], n_stage_runs=counts[1],
                  n_spans=counts[2])
    header["fingerprint"] = fingerprint(header)
    columns = b"".join(np.ascontiguousarray(table[c], dtype="<i8").tobytes()
                       for table, names in ((runs, RUN_COLUMNS), (stage, STAGE_COLUMNS), (spans, SPAN_COLUMNS))
                       for c in names)
    payload = zlib.compress(columns, 6)
    head = _canonical(header)
    body = MAGIC + struct.pack("<Q", len(head)) + head + payload
    return body + hashlib.sha256(body).digest()


def write_plan(path: str | Path, header: dict, runs: dict[str, np.ndarray], stage: dict | None = None,
               spans: dict | None = None) -> Path:
    """Write atomically (runtime/plan/atomic_file.py): a reader never sees part of a plan; one PlanFormatError line on failure."""
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
        header = json.loads(body[start : start + head_len].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise PlanFormatError(f"{origin} has an unreadable header: {str(exc)[:200]}") from None
    if not isinstance(header, dict):
        raise PlanFormatError(f"{origin}: the header is a JSON {type(header).__name__}, not an object")
    version = header.get("format_version")
    if header.get("kind") != "weightplan" or not isinstance(version, int):
        raise PlanFormatError(f"{origin} has no weightplan header")
    if version > FORMAT_VERSION:
        raise PlanFormatError(
            f"{origin} uses plan format {version}, newer than this weightplan reads ({FORMAT_VERSION}); upgrade weightplan"
        )
    if version < BASE_FORMAT_VERSION:
        raise PlanFormatError(f"{origin} uses old plan format {version}; recompile it with compile-plan")
    if ("constants" in header) != (version == FORMAT_VERSION):
        raise PlanFormatError(f"{origin}: format {version} with{'' if 'constants' in header else 'out'} a constants table")
    missing = [key for key in FINGERPRINT_KEYS + ("src_ranks", "dst_ranks", "n_runs", "n_stage_runs", "n_spans")
               if key not in header]
    if missing:
        raise PlanFormatError(f"{origin}: the header has no {missing[0]!r} field")
    check_header(header, origin, DTYPE_SIZES)
    if fingerprint(header) != header.get("fingerprint"):
        raise PlanFormatError(f"{origin}: header fingerprint does not match its contents")
    n, n_stage, n_spans = header["n_runs"], header["n_stage_runs"], header["n_spans"]
    expected = 8 * (n * len(RUN_COLUMNS) + n_stage * len(STAGE_COLUMNS) + n_spans * len(SPAN_COLUMNS))
    payload = body[start + head_len :]
    if expected > _ZLIB_MAX_RATIO * len(payload) + 64:
        raise PlanFormatError(f"{origin}: the header declares {expected} bytes of columns, more than zlib can expand "
                              f"its {len(payload)}-byte payload to")
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
    runs, stage, spans = tables
    for table in tables:
        for column, values in table.items():
            # -1 marks "no trainer rank" (receiver side); every other value is an index, offset, length or stride
            if len(values) and (values.min() < -1 or values.max() >= MAX_ELEMENTS):
                raise PlanFormatError(f"{origin}: column {column!r} holds {int(values.min())}..{int(values.max())}, "
                                      "outside -1..2**48")
    try:
        sources = tuple(TensorEntry(s[0], tuple(s[1]), s[2], s[3]) for s in header["sources"])
        dests = tuple(TensorEntry(d[0], tuple(d[1]), d[2], 0, tuple(d[3])) for d in header["dests"])
        chains = tuple(tuple(c) for c in header["cast_chains"])
        staging = tuple(StagingEntry(e[0], tuple(e[1]), e[2], tuple(e[3]), int(e[4]), int(e[5])) for e in header["staging"])
        constants = tuple(ConstantRun(*row) for row in header.get("constants", ()))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise PlanFormatError(f"{origin}: malformed tensor tables in the header ({exc})") from None
    plan = Plan(header, sources, dests, chains, runs, staging, stage, spans, constants)
    try:
        layout = plan.trainer_layout
        bad = [e.name for e in sources if not 0 <= e.layout < len(layout.classes)]
        bad += [e.name for e in sources if any(b is not None and (len(b) != len(e.shape) or any(
            hi > size for (_, hi), size in zip(b, e.shape))) for b in layout.classes[e.layout])]
        if bad or any(len(c) != header["src_ranks"] for c in layout.classes):
            raise ValueError(f"source {bad[0]!r}" if bad else "a box table does not list every trainer rank")
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise PlanFormatError(f"{origin}: malformed trainer layout in the header ({exc})") from None
    _check_tables(plan, origin)
    _check_quant_tables(plan, origin)
    _check_constants(plan, origin)
    return plan


def _check_constants(plan: Plan, origin: str) -> None:
    for c in plan.constants:
        if not all(type(x) is int for x in (c.dest, c.dst_off, c.length)) or not 0 <= c.dest < len(plan.dests):
            raise PlanFormatError(f"{origin}: a constant names a destination outside the table")
        if c.length <= 0 or c.dst_off < 0 or c.dst_off + c.length > plan.dests[c.dest].numel:
            raise PlanFormatError(f"{origin}: a constant is empty or reaches outside its destination tensor")
        if type(c.value) not in (int, float, bool) or (type(c.value) is float and not np.isfinite(c.value)):
            raise PlanFormatError(f"{origin}: a constant's value {c.value!r} is not a finite number")


def _check_tables(plan: Plan, origin: str) -> None:
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
    plain = count == 1
    if len(count) and ((count < 1).any() or (plain & ((runs["src_stride"] != 0) | (runs["dst_stride"] != 0))).any()
                       or (~plain & ((runs["dst_stride"] < length) | (runs["src_stride"] < 0))).any()):
        raise PlanFormatError(f"{origin}: a strided run has a count below 1, strides on a one-row run, a negative "
                              "source stride or destination rows that overlap")
    ranks = runs["src_rank"]
    if len(ranks) and (ranks.min() < 0 or ranks.max() >= plan.header["src_ranks"]):
        raise PlanFormatError(f"{origin}: a run names a trainer rank outside the plan's {plan.header['src_ranks']}")
    if len(length):
        shard = np.zeros((plan.header["src_ranks"], len(sources)), dtype=np.int64)
        for s, r in set(zip(runs["src"].tolist(), ranks.tolist())):
            shard[r, s] = int(np.prod(plan.local_shape(s, r), dtype=np.int64))
        limits = (("src_off", shard[ranks, runs["src"]], "source shard"),
                  ("dst_off", np.array([e.numel for e in dests], dtype=np.int64)[runs["dest"]], "destination tensor"))
        for column, limit, what in limits:
            offset = runs[column]
            stride = runs["src_stride" if column == "src_off" else "dst_stride"]
            if offset.min() < 0 or (offset + (count - 1) * stride + length > limit).any():
                raise PlanFormatError(f"{origin}: a run reaches outside its {what}")
    for chain in chains:
        for dtype in chain:
            if dtype not in DTYPE_SIZES:
                raise PlanFormatError(f"{origin}: unknown dtype {dtype!r} in a cast chain")


def _check_quant_tables(plan: Plan, origin: str) -> None:
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
        if stage["src_rank"].min() < 0 or stage["src_rank"].max() >= plan.header["src_ranks"]:
            raise PlanFormatError(f"{origin}: a stage run names a trainer rank outside the plan's {plan.header['src_ranks']}")
        expected_quant = np.where(stage["side"] == SENDER, stage["src_rank"], -1)
        gather = stage["side"] == GATHER
        if (stage["quant_rank"][~gather] != expected_quant[~gather]).any() or (stage["quant_rank"][gather] < 0).any() \
                or (stage["quant_rank"][gather] >= plan.header["src_ranks"]).any():
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
        if (spans["src_rank"][trainer] < 0).any() or (spans["src_rank"][trainer] >= plan.header["src_ranks"]).any():
            raise PlanFormatError(f"{origin}: a sender- or gather-side block span names no valid trainer rank")


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file; raises PlanFormatError with the reason on any defect."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; only regular files are read.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise PlanFormatError(f"plan {path} is not a regular file")
            data = file.read()
    except OSError as exc:
        raise PlanFormatError(f"cannot read plan {path}: {exc.strerror or exc}") from None
    return decode_plan(data, str(path))
