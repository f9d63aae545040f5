"""check_coverage: prove every destination byte is written exactly once (by a run, a constant, or fp8 post-load padding)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..ir import Constants, Program
from .verify import PlanInvariantError, verify


def check_coverage(program: Program) -> Program:
    """Record the coverage verify proves, refusing any byte written twice or never.

    A bf16 tensor vLLM quantizes after loading may also have bytes its post-load step sets to zero
    (`QuantTarget.padding`); those count as written. A loader's constants into such a tensor must be
    zero padding too: the quantized weight is computed from the staging, which starts zeroed.
    """
    quantized = program.quantized()
    nonzero = [value for d, value in zip(program.constants.dest.tolist(), program.constants.values)
               if program.dests[d].name in quantized and value != 0]
    if nonzero:
        raise PlanInvariantError(f"fp8_per_block: a loader writes the constant {nonzero[0]} into a tensor vLLM quantizes; "
                                 "only zero padding is supported")
    return dataclasses.replace(program, coverage=verify(with_post_load_padding(program)))


def with_post_load_padding(program: Program) -> Program:
    """`program` with the post-load zero padding of its quantized tensors added as constants."""
    quantized = program.quantized()
    rows = [(d, start, end - start) for d, spec in enumerate(program.dests) if spec.name in quantized
            for start, end in quantized[spec.name].padding]
    if not rows:
        return program
    dest, off, length = (np.array(column, dtype=np.int64) for column in zip(*rows))
    padding = Constants(dest, off, length, (0.0,) * len(rows))
    return dataclasses.replace(program, constants=Constants.concat([program.constants, padding]))
