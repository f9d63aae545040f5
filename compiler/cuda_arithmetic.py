"""CUDA's float arithmetic reproduced on CPU tensors: a division by a Python scalar as a reciprocal multiply, canonical NaNs."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# The ops whose float32 results get CUDA's canonical NaN; enough for vLLM's fp8 block quantization, whose other ops
# (abs, amax, clamp, the casts) move NaNs without arithmetic on both devices.
_ARITHMETIC = {aten.div.Tensor, aten.div_.Tensor, aten.mul.Tensor, aten.mul_.Tensor, aten.reciprocal.default,
               aten.reciprocal_.default}
CANONICAL_NAN_BITS = 0x7FFFFFFF  # every float32 NaN an arithmetic instruction of a GPU returns


def _opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype CUDA's elementwise kernels compute in: float32 for the reduced floats, the dtype itself otherwise."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class CudaArithmetic(TorchDispatchMode):
    """Inside this mode, CPU tensor ops round as PyTorch's CUDA kernels do where the two differ in vLLM's code:

    - `tensor / s` with s a Python number: TensorIterator's GPU path for a CPU-scalar divisor multiplies by
      `opmath(1) / opmath(s)` (ATen's div_true_kernel_cuda); the CPU divides. So vLLM's `x_amax / fp8_max` rounds apart.
    - a float32 NaN out of an arithmetic op is the canonical 0x7FFFFFFF, whatever NaN went in or which sign x86 gives it.

    It is how verify-plan proves a plan with the CUDA scale rounding against vLLM's own functions on this CPU. A 0-dim
    CPU *tensor* divisor is not rewritten: in the code it emulates, such a tensor would live on the GPU.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.div.Tensor, aten.div_.Tensor) and not kwargs and _scalar_divisor(args):
            out = self._scalar_division(func, *args)
        else:
            out = func(*args, **kwargs)
        if func in _ARITHMETIC and isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            out.view(torch.int32).masked_fill_(out.isnan(), CANONICAL_NAN_BITS)
        return out

    @staticmethod
    def _scalar_division(func, a: torch.Tensor, b: float) -> torch.Tensor:
        result = torch.result_type(a, b)
        if not result.is_floating_point:
            return func(a, b)
        opmath = _opmath(result)
        inv = torch.reciprocal(torch.tensor(b, dtype=opmath))
        quotient = torch.mul(a.to(opmath), inv).to(result)
        if func is aten.div_.Tensor:
            return a.copy_(quotient)
        return quotient


def _scalar_divisor(args) -> bool:
    return len(args) == 2 and isinstance(args[0], torch.Tensor) and isinstance(args[1], (int, float)) \
        and not isinstance(args[1], bool)
