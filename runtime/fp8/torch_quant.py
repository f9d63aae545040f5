"""fp8 block quantization in torch ops on the tensors' own device (a GPU's, or the host's as the numba kernel's reference)."""

from __future__ import annotations

import torch

from .format import BLOCK
from .rounding import ScaleRounding, block_scale, canonical_nans_


class TorchTiles:
    """Quantize whole block x block tiles of a bf16 view into fp8 values and float32 scales, on the view's device.

    The math is vLLM's per_block_cast_to_fp8 (amax per tile floored at 1e-4, scale = amax / 448 rounded as `rounding`
    says, value * (1 / scale) cast to e4m3fn, NaNs canonical: runtime/fp8/rounding.py) in the same dtypes, with every
    operand on the view's device, so the bytes do not depend on the device (`make gpu-check` compares a GPU's bytes
    with the host's). It runs a few block rows at a time in buffers reused across calls: fresh multi-megabyte
    temporaries cost page faults on the host and allocator traffic on a GPU.
    """

    def __init__(self, rounding: ScaleRounding, chunk_elements: int = 1 << 18, block: int = BLOCK):
        self.rounding, self.block, self.chunk_elements = ScaleRounding(rounding), block, chunk_elements
        self._bits = torch.empty(0, dtype=torch.int16)
        self._wide = torch.empty(0, dtype=torch.float32)

    def __call__(self, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, hf: int, wf: int) -> None:
        """Tiles x[:hf, :wf] (hf, wf multiples of the block) into values[:hf, :wf] and scales[:hf/B, :wf/B]."""
        b = self.block
        rows = max(b, self.chunk_elements // wf // b * b)
        if self._bits.numel() < rows * wf or self._bits.device != x.device:
            self._bits = torch.empty(rows * wf, dtype=torch.int16, device=x.device)
            self._wide = torch.empty(rows * wf, dtype=torch.float32, device=x.device)
        for r in range(0, hf, rows):
            n = min(rows, hf - r)
            part = x[r : r + n, :wf]
            # |x| as bits: clearing the sign bit orders finite bf16 magnitudes like int16, and amax over
            # integers is exact and 2-3x faster here than abs() then amax() on bf16.
            bits = torch.bitwise_and(part.view(torch.int16), 0x7FFF, out=self._bits[: n * wf].view(n, wf))
            amax = bits.view(n // b, b, wf // b, b).amax(dim=(1, 3))
            nonfinite = amax >= 0x7F80  # inf or NaN in the tile: its NaN bytes are made canonical below
            scale = block_scale(amax.view(torch.bfloat16).float().clamp_(1e-4), self.rounding)
            # 1 / scale repeated along each block's columns, so the multiply runs over whole rows.
            inv = (1.0 / scale).repeat_interleave(b, dim=1).view(n // b, 1, wf)
            wide = torch.mul(part.view(n // b, b, wf), inv, out=self._wide[: n * wf].view(n // b, b, wf))
            values[r : r + n, :wf].copy_(wide.view(n, wf))
            scales[r // b : (r + n) // b, : wf // b] = scale
            # On a GPU, testing first would wait for the device at every chunk.
            if x.device.type != "cpu" or bool(nonfinite.any()):
                canonical_nans_(values[r : r + n, :wf], scales[r // b : (r + n) // b, : wf // b])

