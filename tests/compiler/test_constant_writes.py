"""Constant writes (vLLM's zero padding of vocabularies not a multiple of 64 per shard): traced, verified, executed."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.frontend.errors import ConstantWriteError
from weightplan.compiler.frontend.lazy_weight import LazyWeight, WriteRecorder, tracing
from weightplan.compiler.ir import Program, TensorEntry
from weightplan.compiler.passes.pipeline import Stage, run_stage
from weightplan.compiler.passes.verify import PlanInvariantError, verify
from weightplan.compiler.plan_summary import summarize
from weightplan.compiler.verify_plan import shard_sources, verify_plan
from weightplan.runtime import execute_local, load_plan
from weightplan.runtime.errors import PlanFormatError
from weightplan.runtime.plan.format import decode_plan, encode_plan
from weightplan.runtime.plan.schema import RUN_COLUMNS, ConstantRun

from ..conftest import config_dir
from weightplan.testing.runtime_harness import Job

# (config, trainer format, trainer layout, inference layout); vocab 999 (untied), 1150 (tied, 6 heads: tp=3),
# 50257 (MoE): none a multiple of 64, so every rank pads its shard
CASES = [
    ("vocab-llama", "hf", "fsdp=1", "tp=1"),
    ("vocab-llama", "stacked", "fsdp=2", "tp=2"),
    ("vocab-llama-tied", "hf", "fsdp=1", "tp=3"),
    ("vocab-llama-tied", "stacked", "fsdp=1", "tp=2"),
    ("vocab-qwen3-moe", "stacked", "fsdp=2,ep=2", "dp=2,ep"),
    ("vocab-qwen3-moe", "hf", "fsdp=1", "tp=2"),
]


@pytest.mark.parametrize("model,fmt,trainer,inference", CASES)
def test_padded_vocabularies_match_vllm_load_weights(plan_cache, model, fmt, trainer, inference):
    path = plan_cache(model, fmt, "bf16", trainer, inference)
    plan = load_plan(path)
    assert plan.header.format_version == 5 and plan.constants
    assert {plan.dests[c.dest].name for c in plan.constants} <= {"model.embed_tokens.weight", "lm_head.weight"}
    assert all(c.value == 0 for c in plan.constants)
    result = verify_plan(path, model=str(config_dir(model)), seed=2)
    assert result.mismatches == ()
    assert result.tensors == sum(len(e.ranks) for e in plan.dests)
    summary = summarize(plan)
    assert summary["dst_coverage"] == 1.0
    hidden = json.loads((config_dir(model) / "config.json").read_text())["hidden_size"]
    assert summary["constant_bytes"] == sum(c.length * 2 * len(plan.dests[c.dest].ranks) for c in plan.constants)
    assert summary["constant_bytes"] % (2 * hidden) == 0  # whole padding rows
    assert summary["wire_bytes"] + summary["constant_bytes"] == summary["dst_bytes"]  # constants never on the wire


def test_inspect_plan_shows_constants_apart_from_the_wire(plan_cache):
    from weightplan.compiler.plan_summary import render_text

    plan = load_plan(plan_cache("vocab-llama", "hf"))
    text = render_text(plan, summarize(plan))
    assert re.search(r"constants +9600 bytes in 2 runs, written by the inference ranks, never on the wire", text)


def test_plans_without_constants_keep_format_4_and_no_constants_key(plan_cache):
    plan = load_plan(plan_cache("tiny-llama"))
    assert plan.header.format_version == 4 and "constants" not in plan.header.to_json() and plan.constants == ()


@pytest.mark.parametrize("row,message", [
    ([999, 0, 1, 0.0], "outside the table"),
    ([0, -1, 1, 0.0], "outside its destination"),
    ([0, 0, 0, 0.0], "empty"),
    ([0, 0, 1, "0"], "not a finite number"),
])
def test_reader_refuses_malformed_constants(plan_cache, row, message):
    plan = load_plan(plan_cache("vocab-llama", "hf"))
    header = dataclasses.replace(plan.header, constants=(ConstantRun(*row),))
    with pytest.raises(PlanFormatError, match=message):
        decode_plan(encode_plan(header, {c: plan.table[c] for c in RUN_COLUMNS}))


def test_constants_are_fingerprinted(plan_cache):
    plan = load_plan(plan_cache("vocab-llama", "hf"))
    other = dataclasses.replace(plan.header, constants=tuple(dataclasses.replace(c, value=1.0) for c in plan.constants))
    again = decode_plan(encode_plan(other, {c: plan.table[c] for c in RUN_COLUMNS}))
    assert again.fingerprint != plan.fingerprint


def _meta(*shape):
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16)


def _trace(params, body) -> Program:
    tracer = WriteRecorder(params)
    with tracing(tracer), torch.no_grad():
        body(params)
    dests = tuple(TensorEntry(n, tuple(p.shape), "bfloat16") for n, p in params.items())
    return Program((TensorEntry("w", (6, 4), "bfloat16"),), dests, tuple(tracer.assignments))


def test_fill_zero_and_constant_copies_are_recorded_and_the_later_copy_wins():
    w = LazyWeight.source("w", (6, 4), torch.bfloat16)

    def body(p):
        p["a"].fill_(3.0)  # then mostly overwritten by the copy below
        p["a"][:6].copy_(w)
        p["b"][2:].zero_()
        p["b"][:2].copy_(torch.full((2, 4), 7.0))
        p["c"][:, 1:] = 0  # setitem: a meta scalar tensor expanded and copied
        p["c"][:, :1].copy_(w[:, :1])

    program = run_stage(Stage.PER_RANK, _trace({"a": _meta(8, 4), "b": _meta(5, 4), "c": _meta(6, 4)}, body))
    c = program.constants
    rows = sorted(zip(c.dest.tolist(), c.dst_off.tolist(), c.length.tolist(), c.values))
    assert rows[:3] == [(0, 24, 8, 3.0), (1, 0, 8, 7.0), (1, 8, 12, 0.0)]
    assert [r[3] for r in rows[3:]] == [0.0] * 6 and sum(r[2] for r in rows[3:]) == 18  # c's columns 1..3, row by row
    assert verify(program).fraction == 1.0


def test_a_constant_over_copied_elements_is_refused():
    w = LazyWeight.source("w", (6, 4), torch.bfloat16)

    def body(p):
        p["a"][:6].copy_(w)
        p["a"][5:].fill_(0)

    with pytest.raises(ConstantWriteError, match=r"fill_ into parameter 'a'.*overwrites elements a copy"):
        _trace({"a": _meta(8, 4)}, body)


def test_unhandled_in_place_writes_into_parameters_name_op_and_parameter():
    with pytest.raises(ConstantWriteError, match=r"aten.add_.Tensor into parameter 'a'.*no rule"):
        _trace({"a": _meta(8, 4)}, lambda p: p["a"].add_(1))
    with pytest.raises(ConstantWriteError, match=r"copy_ into parameter 'a'.*meta"):
        _trace({"a": _meta(8, 4)}, lambda p: p["a"].copy_(torch.empty(8, 4, device="meta")))
    _trace({"a": _meta(8, 4)}, lambda p: torch.empty(3, device="meta").add_(1))  # scratch tensors are free to change


def test_uncovered_bytes_name_tensor_range_and_last_write():
    w = LazyWeight.source("w", (6, 4), torch.bfloat16)
    program = run_stage(Stage.PER_RANK, _trace({"a": _meta(8, 4)}, lambda p: p["a"][:6].copy_(w)))
    with pytest.raises(PlanInvariantError) as info:
        verify(program)
    message = str(info.value)
    assert "a [8, 4] bfloat16 (inference ranks [0]) bytes [48, 64) of 64" in message
    assert "last write the tracer saw into it: copy_ of w into elements at offset 0 shape [6, 4]" in message


def test_compile_error_for_an_untraced_gap_is_one_line(tmp_path, monkeypatch):
    """With the constant rule gone, the padding rows show in the error with the loader's last copy."""
    from weightplan.compiler.frontend import lazy_weight

    monkeypatch.setattr(lazy_weight, "_CONSTANT_OPS", {aten: kind for aten, kind in lazy_weight._CONSTANT_OPS.items()
                                                       if kind == "copy"})
    monkeypatch.setattr(lazy_weight, "_WRITES", lazy_weight._WriteTable())
    monkeypatch.setattr(lazy_weight.WriteRecorder, "on_write", lambda self, func, args, kwargs: None)
    with pytest.raises(PlanInvariantError) as info:
        compile_plan(CompileOptions(str(config_dir("vocab-llama")), output=tmp_path / "p.plan"))
    message = str(info.value)
    assert "\n" not in message
    assert "model.embed_tokens.weight [1024, 96] bfloat16 (inference ranks [0]) bytes [191808, 196608)" in message
    assert "loading 'model.embed_tokens.weight'" in message


def _tiny_vocab_config(root, vocab: int):
    config = json.loads((config_dir("vocab-llama") / "config.json").read_text())
    config.update(vocab_size=vocab, num_hidden_layers=1)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


def _weights(plan, seed):
    g = torch.Generator().manual_seed(seed)
    return {e.name: torch.randn(e.shape, generator=g).to(getattr(torch, e.dtype)) for e in plan.sources}


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(vocab=st.integers(65, 700).filter(lambda v: v % 64), tp=st.sampled_from([1, 2, 3]))
def test_padding_rows_hold_zero_after_every_sync(tmp_path_factory, vocab, tp):
    root = _tiny_vocab_config(tmp_path_factory.mktemp("cfg") / f"v{vocab}", vocab)
    padded = -(-vocab // 64) * 64
    tp = tp if padded % tp == 0 else 1  # vLLM needs the padded vocabulary to split evenly
    path = tmp_path_factory.mktemp("plans") / "p.plan"
    compile_plan(CompileOptions(str(root), output=path, inference=f"tp={tp}"))
    plan = load_plan(path)
    shard = padded // tp
    dests = {r: {e.name: torch.full(e.shape, float("nan"), dtype=torch.bfloat16) for e in plan.dests if r in e.ranks}
             for r in range(tp)}
    for seed in (1, 2):  # a second sync with other weights leaves the padding as vLLM's loader does: zero
        full = _weights(plan, seed)
        execute_local(plan, shard_sources(plan, full, {0}), dests)
        for r in range(tp):
            real = max(0, min(shard, vocab - r * shard))
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                got = dests[r][name]
                assert torch.equal(got[:real], full[name][r * shard : r * shard + real])
                assert (got[real:] == 0).all()
    assert summarize(plan)["dst_coverage"] == 1.0


def test_nixl_syncs_write_the_padding_once_and_keep_it(plan_cache, tmp_path):
    """Two inference ranks (tp=2) over real NIXL: vLLM models poisoned with NaN; after each sync the digests equal
    vLLM's own load, padding rows included."""
    plan = plan_cache("vocab-llama-tied", "hf", "bf16", "fsdp=2", "tp=2")
    with Job(tmp_path, plan, "constants-tp2") as job:
        for k in range(2):
            job.start(f"inf{k}", "inference", k, "--versions", "1,2", "--model", str(config_dir("vocab-llama-tied")),
                      "--verify", "--timeout", "60")
        for r in range(2):
            job.start(f"tr{r}", "trainer", r, "--versions", "1,2", "--digests", "--wait-joined", "--timeout", "60")
        for version in (1, 2):
            for k in range(2):
                e = job.event(f"inf{k}", "synced", version)
                assert e["reported"] == version and e["digests"] > 0 and e["n_differ"] == 0, e["differ"]
        job.assert_clean_exit()
