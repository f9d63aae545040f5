"""fp8_per_block plans vs vLLM's own online quantization (load_weights + process_weights_after_loading), digest by digest."""

from __future__ import annotations

import numpy as np
import pytest

from weightplan.compiler.plan_summary import summarize
from weightplan.compiler.verify_plan import verify_plan
from weightplan.runtime import load_plan
from weightplan.runtime.plan.schema import GATHER, RECEIVER, SENDER
from weightplan.runtime.fp8.numerics import span_elements

from ..conftest import config_dir
from ..support.fp8 import CASES


@pytest.fixture(scope="module")
def fp8_plan(plan_cache):
    """case -> path of its fp8 plan, compiled once per session (tests/runtime/test_runtime_fp8.py uses the same cases)."""

    def get(case: str):
        model, fmt, trainer, inference = CASES[case]
        return plan_cache(model, fmt, "bf16", trainer, inference, quant="fp8_per_block")

    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_plan_matches_vllm_online_quantization(fp8_plan, case):
    path = fp8_plan(case)
    plan = load_plan(path)
    result = verify_plan(path, model=str(config_dir(CASES[case][0])), seed=3)
    assert result.mismatches == ()
    assert result.tensors == sum(len(e.ranks) for e in plan.dests)
    summary = summarize(plan)
    assert summary["dst_coverage"] == 1.0
    assert 0.0 <= summary["sender_quantized_fraction"] <= 1.0
    dtypes = {plan.dests[e.weight].dtype for e in plan.staging} | {plan.dests[e.scale].dtype for e in plan.staging}
    assert dtypes == {"float8_e4m3fn", "float32"}


def test_aligned_shards_quantize_on_the_sender_and_unaligned_on_the_receiver(fp8_plan):
    aligned, unaligned = (summarize(load_plan(fp8_plan(c))) for c in ("aligned", "unaligned"))
    assert aligned["sender_quantized_fraction"] > unaligned["sender_quantized_fraction"]
    assert aligned["wire_bytes"] < unaligned["wire_bytes"]


def test_fused_tensor_from_two_trainer_ranks(fp8_plan):
    """fused_qkv_a_proj = q_a (256 rows) + kv_a (192 rows); with 2 trainer ranks its 4 block bands come from
    rank 0, rank 1, both (rows 256-383 mix kv_a's halves: receiver) and rank 1."""
    plan = load_plan(fp8_plan("aligned"))
    stage = next(i for i, e in enumerate(plan.staging) if e.name == "model.layers.0.self_attn.fused_qkv_a_proj.weight")
    spans = plan.spans
    mine = spans["stage"] == stage
    rows = list(zip(spans["first_block"][mine].tolist(), spans["n_blocks"][mine].tolist(), spans["side"][mine].tolist(),
                    spans["src_rank"][mine].tolist()))
    nbc = plan.dests[plan.staging[stage].scale].shape[-1]
    assert rows == [(0, nbc, SENDER, 0), (nbc, nbc, SENDER, 1), (2 * nbc, nbc, RECEIVER, -1), (3 * nbc, nbc, SENDER, 1)]


def test_plan_lists_derived_post_load_work(fp8_plan):
    plan = load_plan(fp8_plan("deepseek"))
    derived = plan.derived
    mla = [d for d in derived if "MLA" in d.what]
    assert mla and all(d.where == "receiver" and any(r.endswith("kv_b_proj.weight") for r in d.reads) for d in mla)
    # moe_intermediate 96 is padded to 128: vLLM's post-load `_zero_padding` is traced as zero constants that fill
    # exactly the bytes no run writes (the zero-filled staging holds them), not listed as derived work
    assert not [d for d in derived if d.where == "plan"]
    assert plan.header.quant_layout.layout == "plain"


def test_sender_blocks_read_only_their_rank(fp8_plan):
    """Executing the sender side with only one rank's shards must work: host_quant.trainer_quantize is given no other."""
    from weightplan.compiler.verify_plan import random_sources, shard_sources, source_reads
    from weightplan.runtime.host.quant import trainer_quantize

    plan = load_plan(fp8_plan("mixed"))
    everything = np.ones(plan.n_stored_runs, dtype=bool)
    full = random_sources(plan, source_reads(plan, everything, np.ones(len(plan.stage["side"]), dtype=bool)), 0)
    shards = shard_sources(plan, full, set(range(plan.header.src_ranks)))
    sender = plan.spans["side"] == SENDER
    assert sender.any()
    for stage, rank in set(zip(plan.spans["stage"][sender].tolist(), plan.spans["src_rank"][sender].tolist())):
        trainer_quantize(plan, stage, SENDER, rank, {rank: shards[rank]})


def test_replicated_straddling_blocks_are_gathered_once_on_a_trainer(fp8_plan):
    """fsdp=3 -> dp=2: blocks across shard ends go to the gather side; bf16 crosses once, not once per holder."""
    plan = load_plan(fp8_plan("gathered"))
    summary = summarize(plan)
    assert summary["gather_quantized_fraction"] > 0
    holders = np.array([len(e.ranks) for e in plan.staging])
    assert (holders[plan.spans["stage"][plan.spans["side"] == RECEIVER]] == 1).all()  # only single-holder tensors pull bf16
    gathered = plan.stage["side"] == GATHER
    remote = gathered & (plan.stage["src_rank"] != plan.stage["quant_rank"])
    assert remote.any() and summary["gather_bytes"] == int(plan.stage["length"][remote].sum()) * 2
    # bf16 of gathered blocks crosses at most once (a writer's own part not at all), however many ranks hold them.
    spans = plan.spans
    gathered_elements = sum(span_elements(plan.staging[s].shape, f, n) for s, f, n, side in zip(
        spans["stage"].tolist(), spans["first_block"].tolist(), spans["n_blocks"].tolist(), spans["side"].tolist()) if side == GATHER)
    assert 0 < summary["gather_bytes"] < 2 * gathered_elements
    assert summary["wire_bytes"] == sum(summary["bytes_per_dst_rank"]) + summary["gather_bytes"]


SAMPLE_SEEDS = range(6)


def _w2_shifted(plan, tmp_path):
    """The plan with every stage copy feeding an expert w2_weight missing its first element (left zero): wrong bytes."""
    from weightplan.runtime.plan.format import write_plan
    from weightplan.runtime.plan.schema import RUN_COLUMNS, SPAN_COLUMNS, STAGE_COLUMNS

    stage = {c: plan.stage[c].copy() for c in STAGE_COLUMNS}
    w2 = np.array([e.name.endswith("w2_weight") for e in plan.staging])
    shifted = w2[stage["stage"]]
    assert shifted.any() and (stage["length"][shifted] > 1).all()
    for column, change in (("src_off", 1), ("stage_off", 1), ("length", -1)):
        stage[column][shifted] += change
    return write_plan(tmp_path / "w2-shifted.plan", plan.header, {c: plan.table[c] for c in RUN_COLUMNS}, stage,
                      {c: plan.spans[c] for c in SPAN_COLUMNS})


def test_sampled_verify_checks_whole_modules_and_catches_a_wrong_stage_copy(fp8_plan, tmp_path):
    """--sample on a quantized plan: each sampled tensor comes with the rest of its module on the same inference
    rank (vLLM quantizes w2 only once w13 is loaded), vLLM's reference loads only what the sample reads, and a
    plan whose w2 stage copies are off by one element fails exactly on the sampled w2 weights."""
    path = fp8_plan("mixed")
    plan = load_plan(path)
    bad = _w2_shifted(plan, tmp_path)
    model = str(config_dir(CASES["mixed"][0]))
    sampled_w2 = 0
    for seed in SAMPLE_SEEDS:
        good = verify_plan(path, model=model, sample=2, seed=seed)
        assert good.mismatches == () and good.tensors == len(good.compared) >= 2
        for entry in good.compared:
            name, rank = entry.split(" (")
            module = name.rsplit(".", 1)[0]
            if name.endswith(".w2_weight"):  # its module's other tensors on that rank were compared with it
                assert {f"{module}.{p} ({rank}" for p in ("w13_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")} <= set(good.compared)
        broken = verify_plan(bad, model=model, sample=2, seed=seed)
        assert broken.compared == good.compared
        w2 = {c for c in broken.compared if c.split(" (")[0].endswith(".w2_weight")}
        assert w2 <= set(broken.mismatches)
        assert all(".w2_weight" in m for m in broken.mismatches)  # the weight and maybe its scale, nothing else
        sampled_w2 += len(w2)
    assert sampled_w2 > 0, "no seed sampled an expert w2_weight: pick other seeds"


def test_verify_on_chosen_inference_ranks(fp8_plan):
    """ranks=[1]: only rank 1's tensors are checked (gather-side blocks reach every holder from one quantizing rank)."""
    path = fp8_plan("gathered")
    plan = load_plan(path)
    result = verify_plan(path, model=str(config_dir(CASES["gathered"][0])), seed=2, ranks=[1])
    assert result.mismatches == ()
    assert len(result.compared) == sum(1 for e in plan.dests if 1 in e.ranks)
    assert all(c.endswith("(inference rank 1)") for c in result.compared)


def test_overlapping_post_load_zero_fills_count_once(plan_cache):
    """tiny-glm's expert weights are padded by vLLM's fp8 post-load step with zero fills that overlap; the
    coverage proof counts their union (it used to refuse the plan: "written twice ... by a constant")."""
    from weightplan.compiler.frontend.fp8_trace import _union

    assert _union([(0, 4), (2, 6), (8, 9), (6, 7)]) == ((0, 7), (8, 9))
    path = plan_cache("tiny-glm", "stacked", "bf16", "fsdp=2", "dp=2,ep", quant="fp8_per_block")
    assert verify_plan(path, model=str(config_dir("tiny-glm")), seed=1).mismatches == ()


@pytest.mark.parametrize("case", ["aligned", "deepseek"])
def test_ieee_rounded_plans_match_vllm_on_this_cpu(plan_cache, case):
    """--scale-rounding ieee: the plan of a CPU engine, proven against vLLM's quantization as this CPU runs it."""
    model, fmt, trainer, inference = CASES[case]
    path = plan_cache(model, fmt, "bf16", trainer, inference, quant="fp8_per_block", scale_rounding="ieee")
    assert load_plan(path).header.quant_layout.scale_rounding.value == "ieee"
    assert verify_plan(path, model=str(config_dir(model)), seed=5).mismatches == ()


def test_a_cuda_rounded_plan_checked_against_the_cpus_rounding_mismatches(fp8_plan, monkeypatch):
    """What makes a CUDA-rounded plan verify on this CPU is running vLLM's function with CUDA's arithmetic: without it,
    vLLM's CPU scales differ from the plan's (so the check can fail)."""
    import contextlib

    from weightplan.compiler import verify_plan as verify_module

    path = fp8_plan("aligned")
    assert load_plan(path).header.quant_layout.scale_rounding.value == "cuda"
    monkeypatch.setattr(verify_module, "platform_rounding", lambda plan: contextlib.nullcontext())
    mismatches = verify_plan(path, model=str(config_dir(CASES["aligned"][0])), seed=3).mismatches
    assert mismatches and all("weight" in str(m) for m in mismatches)
