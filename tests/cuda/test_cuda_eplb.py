"""EPLB plans (`--inference ...,ep,eplb=R`): the header's slots, vLLM's own load on an --enable-eplb engine, refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from weightplan.runtime import load_plan

from ..conftest import config_dir

MODEL = "tiny-qwen3-moe"  # 8 routed experts, 4 MoE layers
EPLB = "dp=2,ep,eplb=2"  # 10 physical slots, 5 per rank: rank 1 holds experts 5, 6, 7 and the redundant 0, 1
FIXTURE = Path(__file__).resolve().parents[1] / "runtime" / "data" / "tiny-qwen3-moe-eplb2.plan"
ROUTED = "model.layers.{}.mlp.experts.routed_experts.{}"


def _layers():
    return tuple((ROUTED.format(i, "w13_weight"), ROUTED.format(i, "w2_weight")) for i in range(4))


@pytest.mark.parametrize("fmt,trainer", [("hf", "fsdp=1"), ("transformers", "fsdp=2")], ids=["hf", "stacked-fsdp2"])
def test_an_eplb_plan_records_its_slots_and_equals_vllms_own_load_on_an_eplb_engine(plan_cache, fmt, trainer):
    """verify-plan builds the engine config from the header (--enable-eplb, 2 redundant experts) and compares every
    destination byte with vLLM's load_weights there: slot p holds the logical expert vLLM's initial map puts there.
    The stacked trainer's experts are one tensor per layer, so coalesce merges neighbouring slots and
    split_expert_slots cuts them again."""
    from weightplan.compiler.verify_plan import verify_plan

    path = plan_cache(MODEL, fmt=fmt, trainer=trainer, inference=EPLB)
    plan = load_plan(path)
    inference = plan.header.inference
    assert inference.token == "tp1-dp2-ep-eplb2" and inference.ep and inference.dp == 2
    eplb = inference.eplb
    assert (eplb.logical_experts, eplb.redundant_experts, eplb.physical_experts) == (8, 2, 10)
    assert eplb.layers == _layers()
    names = {e.name: e for e in plan.dests}
    assert all(names[n].shape[0] == 5 for layer in eplb.layers for n in layer)
    _assert_no_run_crosses_a_slot(plan)
    result = verify_plan(path, model=str(config_dir(MODEL)))
    assert result.mismatches == ()
    assert {c.rsplit("(inference rank ", 1)[1] for c in result.compared} == {"0)", "1)"}
    assert sum(ROUTED.format(0, "w13_weight") in c for c in result.compared) == 2


def test_redundant_slots_read_the_checkpoint_tensors_of_their_logical_expert(plan_cache):
    """Rank 1's local slots 3 and 4 (global 8 and 9) are filled from experts 0 and 1, as vLLM's initial
    physical-to-logical map says (EplbState.build_initial_global_physical_to_logical_map)."""
    plan = load_plan(plan_cache(MODEL, inference=EPLB))
    table, sources = plan.table, plan.sources
    checked = set()
    for i, entry in enumerate(plan.dests):
        if entry.name != ROUTED.format(0, "w13_weight"):
            continue
        slot_size = int(np.prod(entry.shape[1:]))
        for rank in entry.ranks:
            runs = np.flatnonzero(table["dest"] == i)
            read = {}
            for r in runs.tolist():
                slot = int(table["dst_off"][r]) // slot_size
                read.setdefault(slot, set()).add(sources[int(table["src"][r])].name.split(".experts.")[1].split(".")[0])
            want = [(rank * 5 + s) if rank * 5 + s < 8 else (rank * 5 + s - 8) for s in range(5)]
            assert read == {s: {str(e)} for s, e in enumerate(want)}, (rank, read)
            checked.add(rank)
    assert checked == {0, 1}


def _assert_no_run_crosses_a_slot(plan):
    eplb = plan.header.inference.eplb
    experts = {n for layer in eplb.layers for n in layer}
    table = plan.table
    for i, entry in enumerate(plan.dests):
        if entry.name not in experts:
            continue
        size = int(np.prod(entry.shape[1:]))
        mine = table["dest"] == i
        start = table["dst_off"][mine]
        end = start + (table["count"][mine] - 1) * table["dst_stride"][mine] + table["length"][mine]
        assert (start // size == (end - 1) // size).all(), entry.name


# regenerate: .venv-vllm-0.33.0-cuda/bin/compile-plan --model tests/configs/tiny-qwen3-moe --trainer fsdp=2 --inference dp=2,ep,eplb=2 --platform cuda --device h200 -o tests/runtime/data/tiny-qwen3-moe-eplb2.plan
def test_the_checked_in_eplb_fixture_is_what_the_compiler_makes_now(plan_cache):
    fresh = plan_cache(MODEL, trainer="fsdp=2", inference=EPLB)
    assert FIXTURE.exists(), f"{FIXTURE} is missing: regenerate it with the compile-plan command above this test"
    assert FIXTURE.read_bytes() == fresh.read_bytes(), (
        f"{FIXTURE} is stale: regenerate it from the repository root with the compile-plan command in the comment "
        "above this test, and commit it (the runtime's EPLB tests read it)")
    assert load_plan(FIXTURE).header.inference.eplb.layers == _layers()


REFUSALS = {  # --inference (and more flags) -> the start of the one line compile-plan answers
    "without ep": (["--inference", "dp=2,eplb=2"], "error: inference eplb=2 needs ep: "),
    "with pp": (["--inference", "dp=2,pp=2,ep,eplb=2"], "error: inference eplb=2 with pp=2: EPLB plans cover one pipeline stage"),
    "slots not divisible": (["--inference", "dp=2,ep,eplb=1"],
                            "error: inference eplb=1: the 8 routed experts and 1 redundant ones make 9 physical slots, "
                            "which the 2 expert-parallel ranks do not split evenly"),
    "one rank": (["--inference", "ep,eplb=2"], "error: inference eplb=2 needs more than one expert-parallel rank"),
    "bad R": (["--inference", "dp=2,ep,eplb=two"], "error: bad --inference item 'eplb=two' in 'dp=2,ep,eplb=two': "),
    "fp8": (["--inference", EPLB, "--quant", "fp8_per_block", "--moe-backend", "triton"],
            "error: --inference eplb=2 with --quant fp8_per_block is not supported yet"),
}


@pytest.mark.parametrize("case", REFUSALS, ids=list(REFUSALS))
def test_eplb_layouts_the_compiler_cannot_plan_are_refused_in_one_line(case, tmp_path, capsys):
    from weightplan.compiler.cli import compile_main

    args, start = REFUSALS[case]
    out = tmp_path / "refused.plan"
    code = compile_main(["--model", str(config_dir(MODEL)), *args, "--platform", "cuda", "--device", "h200", "-o", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and not out.exists()
    assert err[-1].startswith(start), err[-1]
    assert "Traceback" not in "\n".join(err)


def test_eplb_on_the_cpu_platform_is_refused_in_one_line_naming_vllms_cpu_platform(tmp_path):
    """From the command line, before any platform is set up: vLLM's CPU platform refuses enable_eplb."""
    out = tmp_path / "cpu.plan"
    done = subprocess.run([f"{os.path.dirname(sys.executable)}/compile-plan", "--model", str(config_dir(MODEL)),
                           "--inference", EPLB, "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and not out.exists()
    assert done.stderr.strip() == ("error: inference eplb=2 needs --platform cuda: vLLM's CPU platform refuses enable_eplb "
                                   "(docs/cuda.md, EPLB plans)")


def test_compile_plan_in_process_refuses_eplb_on_a_cpu_trace_too(monkeypatch, tmp_path):
    """compile_plan (the Python API) asks the platform the process traces on."""
    import weightplan.compiler.compile as compile_module
    from weightplan.compiler.frontend.errors import ModelConfigError

    monkeypatch.setattr(compile_module, "trace_platform", lambda: "cpu")
    with pytest.raises(ModelConfigError, match=r"^inference eplb=2 needs --platform cuda: vLLM's CPU platform refuses "):
        compile_module.compile_plan(compile_module.CompileOptions(str(config_dir(MODEL)), inference=EPLB,
                                                                  output=tmp_path / "x.plan"))


def test_eplb_0_turns_eplb_on_without_redundant_slots_and_writes_what_the_plain_ep_plan_writes(plan_cache):
    eplb0 = load_plan(plan_cache(MODEL, inference="dp=2,ep,eplb=0"))
    plain = load_plan(plan_cache(MODEL, inference="dp=2,ep"))
    assert eplb0.header.inference.token == "tp1-dp2-ep-eplb0" and plain.header.inference.eplb is None
    eplb = eplb0.header.inference.eplb
    assert (eplb.logical_experts, eplb.redundant_experts, eplb.layers) == (8, 0, _layers())
    assert eplb0.dests == plain.dests
    assert all((eplb0.table[c] == plain.table[c]).all() for c in ("src", "src_off", "dest", "dst_off", "length", "count"))


def test_parse_inference_reads_eplb_and_check_refuses_what_vllm_or_the_header_cannot_hold():
    from weightplan.compiler.frontend.errors import ModelConfigError
    from weightplan.compiler.layouts import parse_inference

    layout = parse_inference("tp=2,dp=2,ep,eplb=4")
    assert (layout.tp, layout.dp, layout.ep, layout.eplb, layout.token) == (2, 2, True, 4, "tp2-dp2-ep-eplb4")
    assert parse_inference("dp=2,ep").eplb is None and parse_inference("dp=2,ep,eplb=0").eplb == 0
    layout.check({"num_experts": 8, "num_attention_heads": 4})  # 12 slots over 4 ranks
    parse_inference("dp=3,ep,eplb=1").check({"num_experts": 8})  # 9 slots over 3 ranks: E itself need not divide
    with pytest.raises(ModelConfigError, match="^--inference 'dp=2,eplb=1,eplb=2' gives eplb twice$"):
        parse_inference("dp=2,eplb=1,eplb=2")
    with pytest.raises(ModelConfigError, match="needs a MoE model"):
        parse_inference("dp=2,ep,eplb=2").check({"num_attention_heads": 4})
    with pytest.raises(ModelConfigError, match="^inference eplb=2 needs --platform cuda"):
        parse_inference("dp=2,ep,eplb=2").check_platform("cpu")
    parse_inference("dp=2,ep,eplb=2").check_platform("cuda")
    parse_inference("dp=2,ep").check_platform("cpu")


def test_eplb_over_tp_and_dp_ranks_verifies_with_the_shared_dp_models(plan_cache):
    """tp=2 x dp=2 ranks, 4 redundant experts: 12 slots, 3 per rank (rank 2 holds slots 6, 7 = experts 6, 7 and slot 8 =
    expert 0); the DP ranks re-point one shared model per TP rank (its guard compares a real build)."""
    from weightplan.compiler.verify_plan import verify_plan

    path = plan_cache(MODEL, inference="tp=2,dp=2,ep,eplb=4")
    eplb = load_plan(path).header.inference.eplb
    assert (eplb.physical_experts, eplb.layers) == (12, _layers())
    _assert_no_run_crosses_a_slot(load_plan(path))
    result = verify_plan(path, model=str(config_dir(MODEL)))
    assert result.mismatches == () and result.tensors == len(result.compared) > 0
