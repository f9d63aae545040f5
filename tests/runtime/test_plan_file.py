"""Plan file: round-trip, determinism, golden text, and refusal of damaged or foreign files."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from weightplan.compiler.plan_summary import render_text, summarize
from weightplan.runtime import PlanFormatError, load_plan
from weightplan.runtime.plan.format import MAGIC, decode_plan, encode_plan
from weightplan.runtime.plan.schema import RUN_COLUMNS

from ..conftest import with_header_edit

GOLDEN = Path(__file__).parents[1] / "golden"


def test_round_trip_is_exact(plan_cache):
    path = plan_cache("tiny-glm", "stacked", "fp32")
    data = path.read_bytes()
    plan = decode_plan(data)
    again = encode_plan(plan.header, {c: plan.table[c] for c in RUN_COLUMNS})
    assert again == data
    for column in RUN_COLUMNS:
        assert plan.table[column].dtype == np.int64


def test_compiling_twice_gives_identical_bytes(plan_cache, tmp_path):
    from weightplan.compiler.compile import CompileOptions, compile_plan

    from ..conftest import config_dir

    first = plan_cache("tiny-qwen3-moe", "stacked", "bf16")
    second = tmp_path / "again.plan"
    compile_plan(CompileOptions(str(config_dir("tiny-qwen3-moe")), "stacked", "bf16", "none", second))
    assert first.read_bytes() == second.read_bytes()


def test_plan_printer_golden_text(plan_cache):
    plan = load_plan(plan_cache("tiny-llama", "hf", "fp32"))
    text = render_text(plan, summarize(plan), runs=6)
    golden = GOLDEN / "tiny-llama-hf-fp32.txt"
    if os.environ.get("WEIGHTPLAN_REGEN_GOLDEN"):  # regenerate deliberately, then review the diff
        golden.write_text(text)
    assert text == golden.read_text()


def test_truncated_plan_is_refused(plan_cache, tmp_path):
    data = plan_cache("tiny-llama").read_bytes()
    bad = tmp_path / "truncated.plan"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(PlanFormatError, match="truncated or corrupted"):
        load_plan(bad)


def test_corrupted_plan_is_refused(plan_cache, tmp_path):
    data = bytearray(plan_cache("tiny-llama").read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad = tmp_path / "flipped.plan"
    bad.write_bytes(bytes(data))
    with pytest.raises(PlanFormatError, match="truncated or corrupted"):
        load_plan(bad)


def test_not_a_plan_is_refused(tmp_path):
    bad = tmp_path / "x.plan"
    bad.write_text(json.dumps({"hello": 1}) * 10)
    with pytest.raises(PlanFormatError, match="not a weightplan plan file"):
        load_plan(bad)


def test_newer_format_is_refused_with_upgrade_hint(plan_cache, tmp_path):
    bad = tmp_path / "newer.plan"
    bad.write_bytes(with_header_edit(plan_cache("tiny-llama").read_bytes(), lambda header: header.update(format_version=99)))
    with pytest.raises(PlanFormatError, match="newer than this weightplan reads"):
        load_plan(bad)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(PlanFormatError, match="cannot read plan"):
        load_plan(tmp_path / "absent.plan")


@pytest.mark.parametrize("damage, message", [
    (lambda t, i: t["count"].__setitem__(i, t["count"][i] * 1000), "reaches outside its"),
    (lambda t, i: t["dst_stride"].__setitem__(i, t["length"][i] - 1), "destination rows that overlap"),
    (lambda t, i: t["count"].__setitem__(i, 0), "count below 1"),
    (lambda t, i: t["src_stride"].__setitem__(i, -1), "negative source stride"),
])
def test_malformed_strided_runs_are_refused(plan_cache, damage, message):
    """A TP=2 plan stores row-parallel column slices as strided runs; damaging one is refused on read."""
    plan = decode_plan(plan_cache("tiny-glm", "hf", "bf16", "fsdp=3", "tp=2").read_bytes())
    table = {c: plan.table[c].copy() for c in RUN_COLUMNS}
    strided = np.flatnonzero(table["count"] > 1)
    assert len(strided), "the TP=2 plan should hold strided runs"
    damage(table, int(strided[0]))
    with pytest.raises(PlanFormatError, match=message):
        decode_plan(encode_plan(plan.header, table))


@pytest.mark.parametrize("chain", [["bfloat16", "sqrt", "float32"], ["bfloat16", "exp"], ["exp", "bfloat16"], [],
                                   ["bfloat16", 3], ["bfloat16", "scale:nan", "bfloat16"]])
def test_cast_chains_hold_only_dtypes_and_known_elementwise_steps(plan_cache, chain):
    """A chain is a source dtype, dtypes and elementwise steps (exp, neg, scale:<finite float>), then a wire dtype;
    anything else is refused."""
    plan = decode_plan(plan_cache("tiny-glm", "hf", "bf16", "fsdp=1", "tp=1").read_bytes())
    header = dataclasses.replace(plan.header, cast_chains=(tuple(chain),) + plan.header.cast_chains[1:])
    with pytest.raises(PlanFormatError, match=r"cast_chains\[0\].*elementwise steps \(exp, neg, scale:<float>\)"):
        decode_plan(encode_plan(header, {c: plan.table[c] for c in RUN_COLUMNS}))


def _drop(record: str, key: str):
    return lambda header: (header[record] if record else header).pop(key)


def _set(record: str, key: str, value):
    return lambda header: (header[record] if record else header).__setitem__(key, value)


@pytest.mark.parametrize("edit,field,message", [
    (_drop("", "architecture"), "architecture", "is missing"),
    (_drop("", "stats"), "stats", "is missing"),
    (_drop("inference", "platform"), "inference.platform", "is missing"),
    (_drop("trainer", "boxes"), "trainer.boxes", "is missing"),
    (_set("", "colour", "blue"), "colour", "is unknown: not a field of the header"),
    (_set("trainer", "fsdp", 3), "trainer.fsdp", "is unknown: not a field of trainer"),
    (_set("stats", "seconds", 1.5), "stats.seconds", "is unknown: not a field of stats"),
    (_set("", "src_ranks", "3"), "src_ranks", "is 3, not an integer in 1..4096"),
    (_set("", "model", 7), "model", "is 7, not a string"),
    (_set("inference", "ep", 0), "inference.ep", "is not true or false"),
    (_set("inference", "token", None), "inference.token", "is None, not a string"),
    (_set("stats", "assignments", 2.5), "stats.assignments", "is 2.5, not an integer"),
    (_set("", "derived", {}), "derived", "is not a list"),
])
def test_one_reader_names_a_missing_extra_or_mistyped_header_field(plan_cache, edit, field, message):
    """PlanHeader.from_json reads every header: it refuses anything but the fields the writer writes, with their types."""
    data = with_header_edit(plan_cache("tiny-glm", "hf", "bf16", "fsdp=3", "tp=2").read_bytes(), edit)
    with pytest.raises(PlanFormatError, match=re.escape(f"header field {field!r} {message}")):
        decode_plan(data, "edited")


def test_the_header_reads_back_as_written(plan_cache):
    """to_json gives back exactly the stored header object, for plans of formats 4, 5 and 6."""
    for path in (plan_cache("tiny-llama"), plan_cache("vocab-llama", "hf"),
                 plan_cache("tiny-qwen3-moe", "transformers", "bf16", "fsdp=2", "dp=4,ep,gpus-per-node=2")):
        data = path.read_bytes()
        (length,) = struct.unpack_from("<Q", data, len(MAGIC))
        stored = json.loads(data[len(MAGIC) + 8 : len(MAGIC) + 8 + length])
        assert load_plan(path).header.to_json() == stored


def test_strided_runs_expand_to_the_rows_they_stand_for(plan_cache):
    plan = decode_plan(plan_cache("tiny-glm", "hf", "bf16", "fsdp=3", "tp=2").read_bytes())
    t, rows = plan.table, plan.runs
    i = int(np.flatnonzero(t["count"] > 1)[0])
    first = int((t["count"][:i]).sum())
    n = int(t["count"][i])
    assert rows["src_off"][first : first + n].tolist() == [t["src_off"][i] + k * t["src_stride"][i] for k in range(n)]
    assert rows["dst_off"][first : first + n].tolist() == [t["dst_off"][i] + k * t["dst_stride"][i] for k in range(n)]
    assert set(rows["length"][first : first + n].tolist()) == {t["length"][i]}
    assert plan.n_runs == len(rows["length"]) == int(t["count"].sum()) > plan.n_stored_runs
