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

import hashlib
import json
import struct
import zlib
from pathlib import Path

import numpy as np

from ..errors import PlanFormatError
from ..files import MAX_PLAN_BYTES, read_regular_file, write_atomically
from .columns import BlockSpans, Runs, StageRuns
from .coverage import check_coverage
from .header import MAX_ELEMENTS, PlanHeader, canonical_json, fingerprint
from .loaded import Plan
from .invariants import check_constants, check_fanout, check_quant_tables, check_runs
from .schema import RUN_COLUMNS, SPAN_COLUMNS, STAGE_COLUMNS

MAGIC = b"WPLAN\x00\r\n"
# Columns a payload may inflate to: deflate could expand about 1032:1, the plans compile-plan writes stay below 200:1
# (GLM-5.2's MTP plan: 172), so the reader never allocates more than this multiple of the file for its columns.
MAX_EXPANSION = 512


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
