"""The plan file format: schema, deterministic writer, validating reader, fingerprint.

Layout (all integers little-endian):

    magic       8 bytes   b"WPLAN\\x00\\r\\n"
    header_len  u64
    header      canonical JSON (sorted keys, no spaces), UTF-8
    payload     zlib stream of the run columns, each int64[n_runs], in RUN_COLUMNS order
    digest      32 bytes  SHA-256 of everything before it

Reading never unpickles or evaluates anything: JSON plus numpy.frombuffer of int64 columns.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from .errors import PlanFormatError
from .placements import Box
from .shards import ShardLayout

MAGIC = b"WPLAN\x00\r\n"
FORMAT_VERSION = 2
RUN_COLUMNS = ("src_rank", "src", "src_off", "dest", "dst_off", "length", "wire")
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
)
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
class Plan:
    """A loaded plan: header fields, tensor tables and run columns (elements, not bytes)."""

    header: dict
    sources: tuple[TensorEntry, ...]
    dests: tuple[TensorEntry, ...]
    cast_chains: tuple[tuple[str, ...], ...]
    runs: dict[str, np.ndarray] = field(repr=False)

    @property
    def fingerprint(self) -> str:
        return self.header["fingerprint"]

    @cached_property
    def trainer_layout(self) -> ShardLayout:
        """The box of each source every trainer rank holds (see runtime/shards.py)."""
        return ShardLayout.from_header(self.header["trainer"], [(e.name, e.layout) for e in self.sources])

    def shard_box(self, source: int, rank: int) -> Box | None:
        """The box of source `source` that trainer `rank` holds; None if the rank is not in its mesh."""
        return self.trainer_layout.box(source, rank)

    def local_shape(self, source: int, rank: int) -> tuple[int, ...]:
        """Shape of trainer `rank`'s local shard of source `source`; (0,) off its mesh, as DTensor reports."""
        box = self.shard_box(source, rank)
        return (0,) if box is None else tuple(b - a for a, b in box)

    @property
    def n_runs(self) -> int:
        return int(self.runs["length"].shape[0])

    def wire_itemsize(self) -> np.ndarray:
        """Bytes per element on the wire (the destination dtype) for each run."""
        sizes = np.array([DTYPE_SIZES[chain[-1]] for chain in self.cast_chains] or [0], dtype=np.int64)
        return sizes[self.runs["wire"]]


def fingerprint(header: dict) -> str:
    subset = {key: header[key] for key in FINGERPRINT_KEYS}
    return hashlib.sha256(_canonical(subset)).hexdigest()


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def encode_plan(header: dict, runs: dict[str, np.ndarray]) -> bytes:
    """Serialize deterministically; `header` must hold the FINGERPRINT_KEYS fields."""
    n = {len(runs[c]) for c in RUN_COLUMNS}
    if len(n) != 1:
        raise ValueError(f"run columns differ in length: {n}")
    header = dict(header, format_version=FORMAT_VERSION, kind="weightplan", n_runs=n.pop())
    header["fingerprint"] = fingerprint(header)
    columns = b"".join(np.ascontiguousarray(runs[c], dtype="<i8").tobytes() for c in RUN_COLUMNS)
    payload = zlib.compress(columns, 6)
    head = _canonical(header)
    body = MAGIC + struct.pack("<Q", len(head)) + head + payload
    return body + hashlib.sha256(body).digest()


def write_plan(path: str | Path, header: dict, runs: dict[str, np.ndarray]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = encode_plan(header, runs)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # atomic: a reader never sees a half-written plan
    return path


def decode_plan(data: bytes, origin: str = "<bytes>") -> Plan:
    if len(data) < len(MAGIC) + 8 + 32 or not data.startswith(MAGIC):
        raise PlanFormatError(f"{origin} is not a weightplan plan file (bad magic or too short)")
    body, digest = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise PlanFormatError(f"{origin} is truncated or corrupted (checksum mismatch); recompile it with compile-plan")
    (head_len,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    try:
        header = json.loads(body[start : start + head_len].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanFormatError(f"{origin} has an unreadable header: {exc}") from None
    version = header.get("format_version")
    if header.get("kind") != "weightplan" or not isinstance(version, int):
        raise PlanFormatError(f"{origin} has no weightplan header")
    if version > FORMAT_VERSION:
        raise PlanFormatError(
            f"{origin} uses plan format {version}, newer than this weightplan reads ({FORMAT_VERSION}); upgrade weightplan"
        )
    if version < FORMAT_VERSION:
        raise PlanFormatError(f"{origin} uses old plan format {version}; recompile it with compile-plan")
    if fingerprint(header) != header.get("fingerprint"):
        raise PlanFormatError(f"{origin}: header fingerprint does not match its contents")
    n = header["n_runs"]
    try:
        columns = zlib.decompress(body[start + head_len :])
    except zlib.error as exc:
        raise PlanFormatError(f"{origin} has a corrupted payload: {exc}") from None
    if len(columns) != 8 * n * len(RUN_COLUMNS):
        raise PlanFormatError(f"{origin}: payload holds {len(columns)} bytes, expected {8 * n * len(RUN_COLUMNS)}")
    flat = np.frombuffer(columns, dtype="<i8").astype(np.int64)
    runs = {c: flat[i * n : (i + 1) * n] for i, c in enumerate(RUN_COLUMNS)}
    try:
        sources = tuple(TensorEntry(s[0], tuple(s[1]), s[2], s[3]) for s in header["sources"])
        dests = tuple(TensorEntry(d[0], tuple(d[1]), d[2], 0, tuple(d[3])) for d in header["dests"])
        chains = tuple(tuple(c) for c in header["cast_chains"])
    except (KeyError, IndexError, TypeError) as exc:
        raise PlanFormatError(f"{origin}: malformed tensor tables in the header ({exc})") from None
    plan = Plan(header, sources, dests, chains, runs)
    try:
        layout = plan.trainer_layout
        bad = [e.name for e in sources if not 0 <= e.layout < len(layout.classes)]
        bad += [e.name for e in sources if any(b is not None and len(b) != len(e.shape) for b in layout.classes[e.layout])]
        if bad or any(len(c) != header["src_ranks"] for c in layout.classes):
            raise ValueError(f"source {bad[0]!r}" if bad else "a box table does not list every trainer rank")
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise PlanFormatError(f"{origin}: malformed trainer layout in the header ({exc})") from None
    _check_tables(plan, origin)
    return plan


def _check_tables(plan: Plan, origin: str) -> None:
    runs, sources, dests, chains = plan.runs, plan.sources, plan.dests, plan.cast_chains
    for column, table in (("src", sources), ("dest", dests), ("wire", chains)):
        values = runs[column]
        if len(values) and (values.min() < 0 or values.max() >= len(table)):
            raise PlanFormatError(f"{origin}: run column {column!r} indexes outside its table")
    length = runs["length"]
    if len(length) and length.min() <= 0:
        raise PlanFormatError(f"{origin}: a run has non-positive length")
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
            if offset.min() < 0 or (offset + length > limit).any():
                raise PlanFormatError(f"{origin}: a run reaches outside its {what}")
    for chain in chains:
        for dtype in chain:
            if dtype not in DTYPE_SIZES:
                raise PlanFormatError(f"{origin}: unknown dtype {dtype!r} in a cast chain")


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file; raises PlanFormatError with the reason on any defect."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PlanFormatError(f"cannot read plan {path}: {exc.strerror}") from None
    return decode_plan(data, str(path))
