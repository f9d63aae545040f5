"""Where a rank's fp8 buffers live and which quantizer runs there: its tensors' one device, numba only on host memory."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..errors import WeightplanError

FP8_PATHS = ("auto", "device")


@dataclass(frozen=True)
class Fp8Placement:
    """The device of a rank's fp8 values, scales, bf16 stage copies, arenas and staging slots, and whether whole tiles
    go through the device's kernel (`kernel`: numba on the host, Triton on a GPU) or torch ops (runtime/fp8/torch_quant.py)."""

    device: torch.device
    kernel: bool


def fp8_placement(tensors: Iterable[torch.Tensor], fp8_path: str, who: str) -> Fp8Placement:
    """The placement of a rank's fp8 work from the tensors it reads or writes, all on one device.

    `fp8_path` "auto" (the default): host tensors quantize in the numba kernel, CUDA tensors in the Triton kernel on
    their GPU. "device": buffers on the tensors' device, torch-op gathers and torch-op quantization wherever the tensors
    are; on host tensors it is how the tests prove that path's bytes on a machine without a GPU (the Triton kernel's
    are proven interpreted, tests/runtime/test_fp8_triton.py).
    """
    if fp8_path not in FP8_PATHS:
        raise WeightplanError(f"{who}: fp8_path {fp8_path!r} is not one of {', '.join(FP8_PATHS)}")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise WeightplanError(f"{who}: fp8 plans with tensors on several devices ({', '.join(sorted(map(str, devices)))}) "
                              "are not built yet; keep one rank's tensors on one device")
    device = devices.pop() if devices else torch.device("cpu")
    return Fp8Placement(device, fp8_path == "auto")
