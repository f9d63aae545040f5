"""expand_layers: the runs of reused layers equal those of tracing, folding and lowering every layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import config_dir
from weightplan.compiler.frontend.trace import trace_load
from weightplan.compiler.frontend.trainer_formats import Conversion, TrainerFormat, load_trainer_model
from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config
from weightplan.compiler.frontend.vllm_patches import host_independent
from weightplan.compiler.ir import LayerReuse, Program
from weightplan.compiler.passes.expand_layers import expand_layers
from weightplan.compiler.passes.pipeline import Stage, run_stage


def _rows(program: Program) -> list[tuple]:
    """Every run and constant as named rows, in a canonical order."""
    r, c = program.runs, program.constants
    runs = sorted(zip((program.sources[i].name for i in r.src.tolist()), r.src_off.tolist(),
                      (program.dests[i].name for i in r.dest.tolist()), r.dst_off.tolist(), r.length.tolist(),
                      (program.cast_chains[i] for i in r.wire.tolist()), r.count.tolist(), r.src_stride.tolist(),
                      r.dst_stride.tolist()))
    constants = sorted(zip((program.dests[i].name for i in c.dest.tolist()), c.dst_off.tolist(), c.length.tolist(), c.values))
    return runs + constants


@pytest.mark.parametrize("model, fmt", [("tiny-glm", TrainerFormat.TRANSFORMERS), ("tiny-qwen3-moe", TrainerFormat.HF),
                                         ("tiny-llama", TrainerFormat.HF)])
def test_reused_layers_equal_every_layer_traced(model, fmt):
    trainer = load_trainer_model(config_dir(model), torch.bfloat16)  # transformers' model: built outside vLLM's patches
    with host_independent():
        vllm_model = build_model(make_vllm_config(config_dir(model)))
        specs = trainer.specs(fmt)
        reused = trace_load(vllm_model, specs, Conversion(trainer, fmt))
        full = trace_load(vllm_model, specs, Conversion(trainer, fmt), reuse_layers=False)
    assert reused.layer_reuse, "the config has a layer class of three or more layers"
    assert len(reused.assignments) + reused.reused_assignments == len(full.assignments)
    assert sorted(map(repr, reused.expanded())) == sorted(map(repr, full.assignments))
    a = run_stage(Stage.PER_RANK, Program(tuple(specs), tuple(reused.dests), tuple(reused.assignments),
                                          layer_reuse=reused.layer_reuse), check_each=True)
    b = run_stage(Stage.PER_RANK, Program(tuple(specs), tuple(full.dests), tuple(full.assignments)), check_each=True)
    assert a.layer_reuse == () and _rows(a) == _rows(b)
    assert set(a.last_writes) == set(b.last_writes)


def test_only_the_template_layers_destinations_are_copied():
    from weightplan.compiler.ir import Constants, Runs, TensorEntry

    sources = tuple(TensorEntry(f"m.layers.{i}.w", (4,), "float32") for i in range(3)) + (TensorEntry("m.embed", (4,), "float32"),)
    dests = tuple(TensorEntry(f"m.layers.{i}.w", (4,), "float32") for i in range(3)) + (TensorEntry("m.embed", (4,), "float32"),)
    # layer 0 copies elements 0..2 of its own source and fills element 3; the embedding is written from layer 0's source too (not a layer-0 destination)
    runs = Runs.plain(*(np.array(v, dtype=np.int64) for v in ([0, 0], [0, 0], [0, 3], [0, 0], [3, 4], [0, 0], [0, 0])))
    program = Program(sources, dests, runs=runs, cast_chains=(("float32",),), layer_reuse=(LayerReuse(0, 2),),
                      constants=Constants(np.array([0]), np.array([3]), np.array([1]), (0.0,)))  # element 3: a fill
    out = expand_layers(program)
    assert out.runs.src.tolist() == [0, 0, 2] and out.runs.dest.tolist() == [0, 3, 2]
    assert out.constants.dest.tolist() == [0, 2] and out.layer_reuse == ()
