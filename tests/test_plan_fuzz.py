"""Crafted plan files that pass the checksum (re-signed): the reader gives a valid plan or one PlanFormatError, never anything else."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightplan.compiler.plan_summary import summarize
from weightplan.runtime import load_plan
from weightplan.runtime.errors import PlanFormatError, WeightplanError
from weightplan.runtime.plan.format import MAGIC, decode_plan, fingerprint
from weightplan.runtime.plan.schema import RUN_COLUMNS, SPAN_COLUMNS, STAGE_COLUMNS

EXAMPLES = int(os.environ.get("WEIGHTPLAN_FUZZ_EXAMPLES", "150"))  # raise for a longer campaign
HOSTILE_VALUES = [None, True, -1, 0, 1, 7, 2**31, 2**48, 2**63 - 6, 2**64, -(2**63), 1.5, float("inf"), "", "x" * 300,
                  "é\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace"), [], {}, [0], [-1], [[1, 2]],
                  {"a": 1}, [[]] * 3]
HOSTILE_INTS = [-(2**63), -2, -1, 0, 1, 2**31, 2**47, 2**48, 2**62, 2**63 - 6, 2**63 - 1]


def _split(data: bytes) -> tuple[dict, bytes]:
    (head_len,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    return json.loads(data[start:start + head_len]), zlib.decompress(data[start + head_len:-32])


def resign(header, columns: bytes, *, refingerprint: bool = True) -> bytes:
    """A plan file of this header and these raw columns whose fingerprint (when computable) and checksum are right."""
    if refingerprint and isinstance(header, dict):
        try:
            header = dict(header, fingerprint=fingerprint(header))
        except Exception:  # noqa: BLE001 - a header the fingerprint cannot even cover stays as it is
            pass
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    body = MAGIC + struct.pack("<Q", len(head)) + head + zlib.compress(columns, 1)
    return body + hashlib.sha256(body).digest()


def _paths(obj, prefix=()):
    """Every (path, value) inside a JSON value, containers included."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:6]):  # the first few entries of long tables are enough
            yield from _paths(v, prefix + (i,))


def _replace(obj, path, value):
    if not path:
        return value
    copy = dict(obj) if isinstance(obj, dict) else list(obj)
    if value is _DELETE and len(path) == 1:
        del copy[path[0]]
        return copy
    copy[path[0]] = _replace(obj[path[0]], path[1:], value)
    return copy


_DELETE = object()


def _accepts_or_refuses(data: bytes, what: str = "") -> None:
    try:
        plan = decode_plan(data, "fuzzed")
    except PlanFormatError as exc:
        assert "\n" not in str(exc)
        return
    try:
        summary = summarize(plan)  # what inspect-plan prints; it proves coverage with the compiler's verify
    except WeightplanError as exc:  # e.g. bytes written twice: inspect-plan prints this one line and exits 2
        assert "\n" not in str(exc)
        return
    assert 0.0 <= summary["dst_coverage"] <= 1.0, what


@pytest.fixture(scope="module")
def base_plans(plan_cache):
    plans = [plan_cache("tiny-llama", "hf", "fp32", "fsdp=2", "tp=2"),
             plan_cache("fp8-glm", "hf", "bf16", "fsdp=3", "dp=2", quant="fp8_per_block"),
             plan_cache("vocab-llama", "hf", "bf16", "fsdp=1", "tp=2")]
    return [_split(p.read_bytes()) for p in plans]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_resigned_header_edits_are_refused_in_one_line_or_read(base_plans, data):
    header, columns = data.draw(st.sampled_from(base_plans))
    paths = [p for p, _ in _paths(header) if p and p[0] not in ("fingerprint",)]
    path = data.draw(st.sampled_from(paths))
    value = data.draw(st.sampled_from(HOSTILE_VALUES + [_DELETE]))
    _accepts_or_refuses(resign(_replace(header, path, value), columns), f"{path} = {value!r}")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_resigned_column_edits_are_refused_in_one_line_or_read(base_plans, data):
    header, columns = data.draw(st.sampled_from(base_plans))
    flat = np.frombuffer(columns, dtype="<i8").copy()
    edits = []
    if len(flat):
        for _ in range(data.draw(st.integers(1, 3))):
            edits.append((data.draw(st.integers(0, len(flat) - 1)), data.draw(st.sampled_from(HOSTILE_INTS))))
            flat[edits[-1][0]] = edits[-1][1]
    _accepts_or_refuses(resign(header, flat.tobytes()), f"column edits {edits}")


def test_overflowing_offsets_are_refused(base_plans):
    header, columns = base_plans[0]
    n = header["n_runs"]
    flat = np.frombuffer(columns, dtype="<i8").copy()
    for column in ("src_off", "dst_off"):
        flat[RUN_COLUMNS.index(column) * n] = 2**63 - 6
    with pytest.raises(PlanFormatError, match="outside -1..2\\*\\*48"):
        decode_plan(resign(header, flat.tobytes()), "overflow")
    flat = np.frombuffer(columns, dtype="<i8").copy()  # a stride whose last row overflows int64
    first = RUN_COLUMNS.index
    flat[first("count") * n], flat[first("src_stride") * n], flat[first("dst_stride") * n] = 2**40, 2**40, 2**40
    with pytest.raises(PlanFormatError, match="reaches 2\\*\\*48 elements or more"):
        decode_plan(resign(header, flat.tobytes()), "overflow")


def test_a_zlib_bomb_is_refused_before_it_is_inflated(base_plans):
    header, _ = base_plans[0]
    rows = 50_000_000  # 4 GB of columns behind a few MB of zlib
    bomb = dict(header, n_runs=rows, n_stage_runs=0, n_spans=0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    chunk = zlib.compressobj(9)
    payload = b"".join(chunk.compress(bytes(1 << 24)) for _ in range(4)) + chunk.flush()  # 64 MB of zeros
    head = json.dumps(dict(bomb, fingerprint=fingerprint(bomb)), sort_keys=True, separators=(",", ":")).encode()
    body = MAGIC + struct.pack("<Q", len(head)) + head + payload
    with pytest.raises(PlanFormatError, match="more than zlib can expand|does not hold the"):
        decode_plan(body + hashlib.sha256(body).digest(), "bomb")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024  # KiB: well under 512 MB


@pytest.mark.parametrize("edit,message", [
    (lambda h: [1, 2], "the header is a JSON list"),
    (lambda h: dict(h, dst_ranks=0), "'dst_ranks' is 0, not an integer in 1..4096"),
    (lambda h: dict(h, dst_ranks=-3), "'dst_ranks' is -3"),
    (lambda h: dict(h, quant="int4"), "'quant' is 'int4', not one of none, fp8_per_block"),
    (lambda h: dict(h, cast_chains=[[]]), r"'cast_chains\[0\]' is not a list of known dtypes and elementwise steps"),
    (lambda h: dict(h, dests=[[d[0], d[1], d[2], [-1]] for d in h["dests"]]), r"lists inference ranks \[-1\]"),
    (lambda h: dict(h, dests=[[d[0], d[1], d[2], []] for d in h["dests"]]), r"lists inference ranks \[\]"),
    (lambda h: dict(h, dests=[[d[0], d[1], d[2], [0, 0]] for d in h["dests"]]), r"lists inference ranks \[0, 0\]"),
    (lambda h: dict(h, dests=[[d[0], [-4, 2], d[2], d[3]] for d in h["dests"]]), r"has shape \[-4, 2\]"),
    (lambda h: dict(h, sources="x"), "'sources' is not a list"),
])
def test_hand_made_header_edits_name_the_field(base_plans, edit, message):
    header, columns = base_plans[0]
    with pytest.raises(PlanFormatError, match=message):
        decode_plan(resign(edit(header), columns), "edited")


def test_a_deeply_nested_header_is_refused(base_plans):
    header, columns = base_plans[0]
    head = b"[" * 100_000 + b"]" * 100_000
    body = MAGIC + struct.pack("<Q", len(head)) + head + zlib.compress(columns)
    with pytest.raises(PlanFormatError, match="unreadable header"):
        decode_plan(body + hashlib.sha256(body).digest(), "deep")


def test_an_accepted_plan_still_executes(base_plans, plan_cache):
    """The fuzzers' "valid plan" branch is real: an untouched, re-signed plan loads and runs."""
    header, columns = base_plans[0]
    plan = decode_plan(resign(header, columns), "resigned")
    reference = load_plan(plan_cache("tiny-llama", "hf", "fp32", "fsdp=2", "tp=2"))
    assert plan.fingerprint == reference.fingerprint
    assert all(np.array_equal(plan.table[c], reference.table[c]) for c in RUN_COLUMNS)
    assert set(STAGE_COLUMNS) <= set(plan.stage.column_names()) and set(SPAN_COLUMNS) <= set(plan.spans.column_names())
