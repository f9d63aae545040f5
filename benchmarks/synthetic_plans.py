"""Synthetic plans for bench-runtime and the runtime tests: many tiny plain runs, and a tp-style plan of strided runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

RUN_ELEMS = 64  # elements per run of many_runs_plan (128 bytes of bf16)


def write_synthetic(out: Path, name: str, sources, dests, runs, fsdp: int, dst_ranks: int) -> Path:
    """Write a bf16 plan of these tables: dense sources cut by FSDP=`fsdp` along dim 0, `dst_ranks` tp ranks."""
    from weightplan.compiler.ir import PlanOrigin, Program
    from weightplan.compiler.plan_writer import write_program
    from weightplan.runtime.layout.shards import TrainerLayout
    from weightplan.runtime.plan.header import InferenceHeader, TrainerHeader

    layout = TrainerLayout(fsdp=fsdp).bind(sources)
    program = Program(
        sources=sources, dests=dests, runs=runs, cast_chains=(("bfloat16",),),
        origin=PlanOrigin(vllm_version="synthetic", model=name, config_sha256="", architecture="none",
                          trainer=TrainerHeader("hf", "bf16", layout.token, layout.classes),
                          inference=InferenceHeader(f"tp{dst_ranks}", dst_ranks, 1, False, "cpu"),
                          quant="none", src_ranks=fsdp, dst_ranks=dst_ranks),
        trainer_layout=layout,
    )
    write_program(program, out)
    return out


def many_runs_plan(n: int, out: Path) -> Path:
    """One bf16 tensor moved in n runs of RUN_ELEMS elements, read in reverse order so none coalesce."""
    from weightplan.compiler.ir import Runs, TensorEntry

    numel = n * RUN_ELEMS
    i = np.arange(n, dtype=np.int64)
    zeros = np.zeros(n, dtype=np.int64)
    runs = Runs(src=zeros, src_off=(n - 1 - i) * RUN_ELEMS, dest=zeros, dst_off=i * RUN_ELEMS,
                length=np.full(n, RUN_ELEMS, dtype=np.int64), wire=zeros, src_rank=zeros,
                count=np.ones(n, dtype=np.int64), src_stride=zeros, dst_stride=zeros)  # plain runs
    return write_synthetic(out, f"synthetic-{n}", (TensorEntry("synthetic.weight", (numel,), "bfloat16"),),
                           (TensorEntry("synthetic.weight", (numel,), "bfloat16", ranks=(0,)),), runs, 1, 1)


def tp_plan(out: Path, matrices: int, rows: int, width: int, row_width: int) -> Path:
    """2 trainer ranks (FSDP over rows) and 2 tp ranks: `matrices` column-parallel [2*rows, 2*width] bf16 tensors
    whose rank-k slices are strided runs of `rows` rows of `width` elements (like MoE down_proj column slices),
    and as many row-parallel [2*rows, row_width] tensors, each rank's half one contiguous run from one trainer."""
    from weightplan.compiler.ir import Runs, TensorEntry

    sources, dests, columns = [], [], []
    for m in range(matrices):
        for kind, shape in (("col", (2 * rows, 2 * width)), ("row", (2 * rows, row_width))):
            source = len(sources)
            sources.append(TensorEntry(f"layers.{m}.{kind}.weight", shape, "bfloat16"))
            for k in range(2):
                dest = len(dests)
                local = (2 * rows, width) if kind == "col" else (rows, row_width)
                dests.append(TensorEntry(f"rank{k}.layers.{m}.{kind}.weight", local, "bfloat16", ranks=(k,)))
                if kind == "col":  # trainer r's rows, columns [k*width, (k+1)*width)
                    columns += [(source, k * width, dest, r * rows * width, width, r, rows, 2 * width, width) for r in range(2)]
                else:  # rows [k*rows, (k+1)*rows) are trainer k's whole shard
                    columns.append((source, 0, dest, 0, rows * row_width, k, 1, 0, 0))
    c = np.array(columns, dtype=np.int64).T
    runs = Runs(src=c[0], src_off=c[1], dest=c[2], dst_off=c[3], length=c[4], wire=np.zeros(len(c[0]), dtype=np.int64),
                src_rank=c[5], count=c[6], src_stride=c[7], dst_stride=c[8])
    return write_synthetic(out, f"synthetic-tp-{matrices}x{rows}x{width}", tuple(sources), tuple(dests), runs, 2, 2)
