"""Crafted plan files that pass the checksum (re-signed): the reader gives a valid plan or one PlanFormatError, never anything else."""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import struct
import zlib
from dataclasses import replace as dataclass_replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightplan.compiler.plan_summary import summarize
from weightplan.runtime import load_plan
from weightplan.runtime.errors import PlanFormatError, WeightplanError
from weightplan.runtime.plan.format import MAGIC, decode_plan, fingerprint
from weightplan.runtime.plan.schema import DTYPE_SIZES, RUN_COLUMNS, SPAN_COLUMNS, STAGE_COLUMNS

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
             plan_cache("vocab-llama", "hf", "bf16", "fsdp=1", "tp=2"),
             plan_cache("tiny-qwen3-moe", "transformers", "bf16", "fsdp=2", "dp=4,ep,gpus-per-node=2")]  # format 6
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
    with pytest.raises(PlanFormatError, match="more than 512 times|does not hold the"):
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


# --- coverage: the reader proves every destination element is written exactly once ---------------------------------


def _without_run(header, columns: bytes, drop: int) -> bytes:
    """The plan with stored run `drop` removed (or, negative, run -drop - 1 stored twice), re-signed."""
    n = header["n_runs"]
    table = np.frombuffer(columns, dtype="<i8")[: n * len(RUN_COLUMNS)].reshape(len(RUN_COLUMNS), n)
    rest = np.frombuffer(columns, dtype="<i8")[n * len(RUN_COLUMNS):]
    rows = np.delete(np.arange(n), drop) if drop >= 0 else np.append(np.arange(n), -drop - 1)
    return resign(dict(header, n_runs=len(rows)), table[:, rows].tobytes() + rest.tobytes())


@pytest.mark.parametrize("plan", [0, 1, 2])
def test_a_plan_missing_a_run_is_refused_naming_the_unwritten_bytes(base_plans, plan):
    header, columns = base_plans[plan]
    for drop in (0, header["n_runs"] // 2, header["n_runs"] - 1):
        with pytest.raises(PlanFormatError, match=r"not fully written: '.+' \S+\[.*\] \(inference ranks .*\) has \d+ of its "
                                                  r"\d+ bytes unwritten") as info:
            decode_plan(_without_run(header, columns, drop), "short")
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("plan", [0, 1, 2])
def test_a_plan_writing_an_element_twice_is_refused(base_plans, plan):
    header, columns = base_plans[plan]
    with pytest.raises(PlanFormatError, match=r"has element \d+ written twice"):
        decode_plan(_without_run(header, columns, -1), "twice")


def test_fp8_blocks_quantized_never_or_twice_are_refused(base_plans):
    header, columns = base_plans[1]
    n, n_stage, n_spans = header["n_runs"], header["n_stage_runs"], header["n_spans"]
    assert n_spans > 1
    flat = np.frombuffer(columns, dtype="<i8")
    spans_at = n * len(RUN_COLUMNS) + n_stage * len(STAGE_COLUMNS)
    spans = flat[spans_at:].reshape(len(SPAN_COLUMNS), n_spans)
    for keep, message in ((np.arange(1, n_spans), "never quantized|block spans quantize"),
                          (np.append(np.arange(n_spans), 0), "quantized twice")):
        data = resign(dict(header, n_spans=len(keep)), flat[:spans_at].tobytes() + spans[:, keep].tobytes())
        with pytest.raises(PlanFormatError, match=f"fp8 tensor '.+': .*({message})"):
            decode_plan(data, "fp8")


@pytest.mark.parametrize("value", [2**70, 1e300, -(2**63) - 1, 1e39, -4e38])
def test_constants_out_of_range_for_their_dtype_are_refused(base_plans, value):
    header, columns = base_plans[2]  # vocab-llama: bf16 vocabulary padding written as constants
    assert header.get("constants")
    edited = dict(header, constants=[[*row[:3], value] for row in header["constants"]])
    with pytest.raises(PlanFormatError, match=r"a constant's value .* does not fit destination '.+' \(bfloat16\)"):
        decode_plan(resign(edited, columns), "constant")
    decode_plan(resign(dict(header, constants=[[*row[:3], 3.0e38] for row in header["constants"]]), columns), "fits")


def test_a_strided_run_with_gaps_another_fills_is_read_row_by_row(base_plans):
    """Runs whose rows interleave (a strided run with another in its gaps) cover a tensor exactly once: accepted."""
    from weightplan.runtime.plan.columns import Runs
    from weightplan.runtime.plan.coverage import check_coverage

    header, columns = base_plans[0]
    plan = decode_plan(resign(header, columns), "base")
    d = int(np.argmax([e.numel for e in plan.dests]))
    numel = plan.dests[d].numel
    rows = numel // 2
    mine = np.flatnonzero(plan.table.dest == d)
    base = plan.table.take(np.flatnonzero(plan.table.dest != d))
    src, rank, wire = int(plan.table.src[mine[0]]), int(plan.table.src_rank[mine[0]]), int(plan.table.wire[mine[0]])
    even = Runs(*(np.array([v]) for v in (src, 0, d, 0, 1, wire, rank, rows, 0, 2)))  # elements 0, 2, 4, ...
    odd = Runs(*(np.array([v]) for v in (src, 0, d, 1, 1, wire, rank, rows, 0, 2)))  # elements 1, 3, 5, ...
    woven = dataclass_replace(plan, table=Runs.concat([base, even, odd]))
    check_coverage(woven, "woven")
    with pytest.raises(PlanFormatError, match="written twice"):
        check_coverage(dataclass_replace(plan, table=Runs.concat([base, even, even, odd])), "twice")
    with pytest.raises(PlanFormatError, match=f"has {plan.dests[d].nbytes // 2} of its {plan.dests[d].nbytes} bytes unwritten"):
        check_coverage(dataclass_replace(plan, table=Runs.concat([base, even])), "half")


@pytest.mark.parametrize("field,value", [("chosen_mean", 0.0), ("greedy_mean", -1.0), ("method", "guess")])
def test_a_malformed_source_choice_is_refused(plan_cache, field, value):
    header, columns = _split(plan_cache("tiny-llama", "hf", "bf16", "fsdp=2,replicas=2", "tp=2").read_bytes())
    choice = header["stats"]["source_choice"]
    edited = dict(header, stats=dict(header["stats"], source_choice=dict(choice, **{field: value})))
    with pytest.raises(PlanFormatError, match=f"'stats.source_choice.{field}' is"):
        decode_plan(resign(edited, columns), "choice")


def test_verify_plan_on_a_plan_missing_a_run_names_the_unwritten_bytes(base_plans, tmp_path, capsys):
    from weightplan.compiler.cli import verify_main

    header, columns = base_plans[0]
    path = tmp_path / "short.plan"
    path.write_bytes(_without_run(header, columns, 0))
    assert verify_main([str(path), "--model", "tests/configs/tiny-llama"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "bytes unwritten" in err


CLI_EXAMPLES = int(os.environ.get("WEIGHTPLAN_CLI_FUZZ_EXAMPLES", "60"))
EXECUTE_BYTES = 1 << 30  # accepted plans whose tensors fit in this run through the host executor


@settings(max_examples=CLI_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_resigned_mutations_through_the_commands_are_one_error_line_or_a_report(base_plans, tmp_path, capsys, data):
    """Header fields and table entries of formats 4-6 (fp8 and fan-out included), re-signed, through inspect-plan (text, JSON, HTML),
    simulate-plan (text, JSON) and, where they accept the plan, execute_local: exit 0 with a report or exit 2 with one
    `error:` line, and the executor runs or raises one WeightplanError, never a traceback."""
    from weightplan.compiler.cli import inspect_main, simulate_main

    header, columns = data.draw(st.sampled_from(base_plans))
    if data.draw(st.booleans()):
        paths = [p for p, _ in _paths(header) if p and p[0] != "fingerprint"]
        mutated = resign(_replace(header, data.draw(st.sampled_from(paths)), data.draw(st.sampled_from(HOSTILE_VALUES + [_DELETE]))),
                         columns)
    else:
        flat = np.frombuffer(columns, dtype="<i8").copy()
        flat[data.draw(st.integers(0, len(flat) - 1))] = data.draw(st.sampled_from(HOSTILE_INTS))
        mutated = resign(header, flat.tobytes())
    path = tmp_path / "mutated.plan"
    path.write_bytes(mutated)
    capsys.readouterr()
    codes = []
    for main, args in ((inspect_main, []), (inspect_main, ["--json"]), (inspect_main, ["--html", str(tmp_path / "r.html")]),
                       (simulate_main, ["--cluster", "loopback"]), (simulate_main, ["--cluster", "loopback", "--json"])):
        code = main([str(path), *args])
        out, err = capsys.readouterr()
        assert code in (0, 2), (main.__name__, args, code)
        if code == 2:
            assert err.startswith("error: ") and err.count("\n") == 1, err
        else:
            assert out, (main.__name__, args)
        codes.append(code)
    # One reader for every command: each command agrees across its output forms, and a plan inspect-plan refuses
    # simulate-plan refuses too (simulate-plan also refuses plans with more ranks than the loopback cluster has GPUs).
    assert len(set(codes[:3])) == 1 and len(set(codes[3:])) == 1 and (codes[0] == 0 or codes[3] == 2), codes
    if codes[0] == 0:  # a plan every reader accepts runs through the host executor, or is refused in one WeightplanError
        from weightplan.runtime import execute_local, load_plan
        from weightplan.runtime.errors import WeightplanError

        from weightplan.testing.runtime_worker import full_weights, plain_destination, shard

        plan = load_plan(path)
        # A mutated shape can make a valid plan of a model far larger than this test's memory (a source of 512 GB
        # is a legal plan): the host executor runs only plans whose tensors this process can hold.
        held = sum(math.prod(e.shape) * DTYPE_SIZES[e.dtype] for e in (*plan.sources, *plan.dests))
        if held > EXECUTE_BYTES:
            return
        full = full_weights(plan, 0, 1)
        try:
            execute_local(plan, {r: shard(plan, full, r) for r in range(plan.header.src_ranks)},
                          {k: plain_destination(plan, k) for k in range(plan.header.dst_ranks)})
        except WeightplanError as exc:
            assert "\n" not in str(exc), exc
