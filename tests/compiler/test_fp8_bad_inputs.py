"""fp8 bad inputs: unknown --quant, a config vLLM cannot quantize online, corrupted fp8 tables; clear errors, no plan."""

from __future__ import annotations

import numpy as np
import pytest

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.frontend.errors import ModelConfigError
from weightplan.compiler.frontend.fp8_kernels import KERNEL_LAYOUT
from weightplan.runtime.errors import PlanFormatError
from weightplan.runtime.plan.format import decode_plan, encode_plan
from weightplan.runtime.plan.header import InferenceHeader, PlanHeader, TrainerHeader
from weightplan.runtime.plan.schema import RUN_COLUMNS, SPAN_COLUMNS, STAGE_COLUMNS, StagingEntry, TensorEntry

from ..conftest import config_dir


def test_unknown_quant_lists_the_supported_ones(tmp_path):
    out = tmp_path / "never.plan"
    with pytest.raises(ModelConfigError, match=r"unknown --quant 'fp8_per_tensor'.*none, fp8_per_block"):
        compile_plan(CompileOptions(str(config_dir("tiny-llama")), quant="fp8_per_tensor", output=out))
    assert not out.exists()


def test_a_model_without_online_quantized_layers_is_refused():
    from weightplan.compiler.quant_compile import quant_mode

    fp8 = quant_mode("fp8_per_block")
    with pytest.raises(ModelConfigError, match="vLLM quantizes no layer of this model online; compile with --quant none"):
        fp8.targets(fp8.hooks())


def test_every_plan_header_quant_has_one_compile_mode():
    from weightplan.compiler.quant_compile import QUANT_MODES, quant_mode
    from weightplan.runtime.plan.header import QUANTS

    assert tuple(QUANT_MODES) == QUANTS
    assert all(quant_mode(name).name == name for name in QUANTS)


def _tiny_fp8_plan_bytes(staging_rows, stage, spans) -> bytes:
    header = PlanHeader(
        vllm_version="0.32.0", model="x", config_sha256="0", architecture="X",
        trainer=TrainerHeader("hf", "bf16", "fsdp1", ((((0, 256), (0, 128)),),)), inference=InferenceHeader("tp1", 1, 1, False, "cpu"),
        quant="fp8_per_block", src_ranks=1, dst_ranks=1, sources=(TensorEntry("w", (256, 128), "bfloat16"),),
        dests=(TensorEntry("l.weight", (256, 128), "float8_e4m3fn"), TensorEntry("l.weight_scale_inv", (2, 1), "float32")),
        cast_chains=(("bfloat16",),), staging=tuple(StagingEntry.from_row(row) for row in staging_rows), quant_layout=KERNEL_LAYOUT,
    )
    runs = {c: np.zeros(0, dtype=np.int64) for c in RUN_COLUMNS}
    return encode_plan(header, runs, {c: np.array(v, dtype=np.int64) for c, v in zip(STAGE_COLUMNS, stage)},
                       {c: np.array(v, dtype=np.int64) for c, v in zip(SPAN_COLUMNS, spans)})


GOOD_STAGE = ([0], [0], [0], [0], [0], [0], [0], [256 * 128], [0])  # side, src_rank, quant_rank, src, src_off, stage, stage_off, length, wire
GOOD_SPANS = ([0], [0], [2], [0], [0])  # stage, first_block, n_blocks, side, src_rank
STAGING = [["l.weight", [256, 128], "bfloat16", [0], 0, 1]]


def test_a_well_formed_fp8_plan_decodes():
    plan = decode_plan(_tiny_fp8_plan_bytes(STAGING, GOOD_STAGE, GOOD_SPANS))
    assert plan.staging[0].name == "l.weight" and plan.spans["n_blocks"].tolist() == [2]


@pytest.mark.parametrize("stage,spans,staging,message", [
    (GOOD_STAGE, ([0], [1], [2], [0], [0]), STAGING, "past its tensor's last block"),
    (GOOD_STAGE, ([0], [0], [2], [3], [0]), STAGING, "side other than 0"),
    (GOOD_STAGE, ([0], [0], [2], [0], [-1]), STAGING, "sender- or gather-side block span names no valid trainer rank"),
    (GOOD_STAGE, ([0], [0], [2], [2], [1]), STAGING, "sender- or gather-side block span names no valid trainer rank"),
    (([1], [0], [-1], [0], [0], [0], [1], [256 * 128], [0]), GOOD_SPANS, STAGING, "outside its staging tensor"),
    (([1], [0], [-1], [0], [5], [0], [0], [256 * 128], [0]), GOOD_SPANS, STAGING, "outside its source shard"),
    (([0], [0], [-1], [0], [0], [0], [0], [256 * 128], [0]), GOOD_SPANS, STAGING, "quant_rank is not its own rank"),
    (([1], [0], [0], [0], [0], [0], [0], [256 * 128], [0]), GOOD_SPANS, STAGING, "quant_rank is not its own rank"),
    (([2], [0], [1], [0], [0], [0], [0], [256 * 128], [0]), GOOD_SPANS, STAGING, "a valid trainer rank \\(gather side\\)"),
    (GOOD_STAGE, GOOD_SPANS, [["l.weight", [256, 128], "bfloat16", [0], 0, 7]], "names a destination outside the table"),
])
def test_corrupted_fp8_tables_are_refused(stage, spans, staging, message):
    with pytest.raises(PlanFormatError, match=message):
        decode_plan(_tiny_fp8_plan_bytes(staging, stage, spans))
