"""compiler/cuda_arithmetic.py: CUDA's rounding of a division by a Python scalar and its canonical NaNs, on CPU tensors."""

from __future__ import annotations

import numpy as np
import torch

from weightplan.compiler.cuda_arithmetic import CANONICAL_NAN_BITS, CudaArithmetic


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int32).numpy().view(np.uint32)


def test_a_scalar_divisor_becomes_a_multiply_by_its_float32_reciprocal():
    x = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 1e3
    with CudaArithmetic():
        quotient = x / 448.0
        inplace = x.clone()
        inplace /= 7.0
    assert np.array_equal(_bits(quotient), _bits(x * torch.reciprocal(torch.tensor(448.0))))
    assert np.array_equal(_bits(inplace), _bits(x * torch.reciprocal(torch.tensor(7.0))))
    assert not torch.equal(quotient, x / 448.0)  # the CPU's division rounds some elements apart


def test_bf16_divides_in_float32_and_rounds_once():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with CudaArithmetic():
        quotient = x / 3.0
    expected = (x.float() * torch.reciprocal(torch.tensor(3.0))).to(torch.bfloat16)
    assert quotient.dtype == torch.bfloat16 and torch.equal(quotient.view(torch.int16), expected.view(torch.int16))


def test_tensor_divisors_and_integer_division_are_left_alone():
    x = torch.rand(1000, generator=torch.Generator().manual_seed(2))
    with CudaArithmetic():
        by_tensor = x / torch.tensor(448.0)
        ints = torch.arange(10) // 3
    assert torch.equal(by_tensor, x / torch.tensor(448.0)) and torch.equal(ints, torch.arange(10) // 3)


def test_arithmetic_nans_are_canonical():
    x = torch.tensor([float("nan"), -float("nan"), float("inf"), 1.0])
    with CudaArithmetic():
        products = x * torch.tensor([1.0, 1.0, 0.0, 1.0])
        reciprocals = torch.reciprocal(x)
        quotient = x / 448.0
    for t in (products, quotient):
        assert (_bits(t)[:3 if t is products else 2] == CANONICAL_NAN_BITS).all()
    assert (_bits(reciprocals)[:2] == CANONICAL_NAN_BITS).all()
    assert products[3] == 1.0 and reciprocals[2] == 0.0
