"""The two roundings of an fp8 block scale (amax / 448) a plan may name, and the NaN bytes every path writes."""

from __future__ import annotations

import enum

import numpy as np
import torch

from .format import FP8_MAX


class ScaleRounding(str, enum.Enum):
    """How `scale = amax / 448` rounds, in vLLM's per_block_cast_to_fp8 (`x_amax / fp8_max`, a Python float divisor).

    CUDA: PyTorch on a GPU divides a tensor by a CPU scalar as a multiply by the scalar's float32 reciprocal,
    fl32(amax * fl32(1 / 448)): what a GPU engine's own online quantization gives, and the default.
    IEEE: the CPU divides, fl32(amax / 448): what a CPU engine gives (verify-plan's reference on a CPU).
    They differ in about half of all block scales. The rest of the math is the same under both: inv = fl32(1 / scale)
    (IEEE on both devices), value = e4m3fn(fl32(float(x) * inv)) rounded to nearest even as c10 does.
    """

    CUDA = "cuda"
    IEEE = "ieee"


SCALE_ROUNDINGS = tuple(r.value for r in ScaleRounding)
RECIPROCAL = float(np.float32(1.0 / FP8_MAX))  # fl32(1 / 448), exactly representable as a Python float

# A NaN scale is stored as these float32 bits and a NaN value as this e4m3fn byte, under both roundings: CUDA's
# canonical NaN, which every arithmetic NaN on a GPU is. A CPU keeps input payloads and makes negative NaNs (x86's
# default NaN), so without this a tile holding inf or NaN would get other bytes from a host path than from a device
# one. Such a tile means the trainer diverged; its bytes are defined only so that every path agrees.
NAN_SCALE_BITS = 0x7FFFFFFF
NAN_VALUE_BYTE = 0x7F


def rounding_of(name: str) -> ScaleRounding:
    """The ScaleRounding named `name` (ValueError naming the choices otherwise)."""
    try:
        return ScaleRounding(name)
    except ValueError:
        raise ValueError(f"fp8 scale rounding {name!r} is not one of {', '.join(SCALE_ROUNDINGS)}") from None


def block_scale(amax: torch.Tensor, rounding: ScaleRounding) -> torch.Tensor:
    """float32 scales of float32 `amax` (already floored at 1e-4) under `rounding`, the same bytes on any device.

    The divisor or factor is a tensor on amax's own device: a CPU-scalar divisor is exactly what a GPU rounds
    differently, and a device tensor operand takes TensorIterator's plain elementwise kernel on every device.
    """
    if ScaleRounding(rounding) is ScaleRounding.CUDA:
        return torch.mul(amax, torch.tensor(RECIPROCAL, dtype=torch.float32, device=amax.device))
    return torch.div(amax, torch.tensor(FP8_MAX, dtype=torch.float32, device=amax.device))


def canonical_nans_(values: torch.Tensor, scales: torch.Tensor) -> None:
    """Rewrite, in place, NaN scales to NAN_SCALE_BITS and NaN fp8 values (0x7f, 0xff) to NAN_VALUE_BYTE."""
    bits = scales.view(torch.int32)
    bits.masked_fill_(scales.isnan(), NAN_SCALE_BITS)
    raw = values.view(torch.uint8)
    raw.masked_fill_(raw == 0xFF, NAN_VALUE_BYTE)
