"""verify_quant: every block quantized exactly once on one side; sender blocks read only their own rank's shard."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...runtime.quant import block_grid
from .place_quant import block_ranges
from .verify import PlanInvariantError

SENDER, RECEIVER = 0, 1


@dataclass(frozen=True)
class QuantCoverage:
    blocks: int  # blocks over all staging tensors, once per inference rank holding them
    sender_blocks: int

    @property
    def sender_fraction(self) -> float:
        return self.sender_blocks / self.blocks if self.blocks else 0.0


def verify_quant(shapes: list[tuple[int, ...]], holders: list[int], stage: dict, spans: dict) -> QuantCoverage:
    """Check the fp8 tables of a plan (staging shapes, inference ranks per staging tensor, stage runs, spans)."""
    blocks = sender_blocks = 0
    for index, shape in enumerate(shapes):
        matrices, nbr, nbc = block_grid(shape)
        count = np.zeros(matrices * nbr * nbc, dtype=np.int64)
        side = np.full(len(count), -1, dtype=np.int64)
        owner = np.full(len(count), -1, dtype=np.int64)
        mine = np.flatnonzero(spans["stage"] == index)
        for i in mine.tolist():
            lo, hi = int(spans["first_block"][i]), int(spans["first_block"][i] + spans["n_blocks"][i])
            count[lo:hi] += 1
            side[lo:hi] = spans["side"][i]
            owner[lo:hi] = spans["src_rank"][i]
        if (count != 1).any():
            b = int(np.flatnonzero(count != 1)[0])
            raise PlanInvariantError(f"staging tensor {index} {shape}: block {b} is quantized {count[b]} times, not once")
        runs = np.flatnonzero(stage["stage"] == index)
        copies = {(int(stage["side"][i]), int(stage["stage_off"][i]), int(stage["length"][i]), int(stage["src_rank"][i]))
                  for i in runs.tolist()}
        for run_side, off, length, rank in copies:
            for lo, hi in block_ranges(shape, off, length):
                sides, owners = side[lo:hi], owner[lo:hi]
                stray = np.flatnonzero((sides == SENDER) & (owners != rank))
                if len(stray):
                    b = lo + int(stray[0])
                    raise PlanInvariantError(f"staging tensor {index}: sender-side block {b} of trainer rank {owner[b]} "
                                             f"is also written from trainer rank {rank}")
                for wanted, where in ((SENDER, "sender"), (RECEIVER, "receiver")):
                    if (sides == wanted).any() and (wanted, off, length, rank) not in copies:
                        b = lo + int(np.flatnonzero(sides == wanted)[0])
                        raise PlanInvariantError(f"staging tensor {index}: block {b} is quantized on the {where} side but "
                                                 f"its stage run [{off}:+{length}] from trainer rank {rank} does not go there")
        blocks += len(count) * holders[index]
        sender_blocks += int((side == SENDER).sum()) * holders[index]
    return QuantCoverage(blocks, sender_blocks)
