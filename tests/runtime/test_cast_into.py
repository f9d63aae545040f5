"""`cast_into` (the sender's staging and packing write a chain's result straight into the wire buffer) gives the bytes
of `cast_along` then a copy, for every chain of dtypes and elementwise steps."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightplan.runtime.casts import cast_along, cast_into, scale_step

DTYPES = ["bfloat16", "float16", "float32"]
STEPS = st.one_of(st.sampled_from(DTYPES + ["exp", "neg"]),
                  st.floats(min_value=-1e3, max_value=1e3, allow_nan=False).filter(bool).map(scale_step))


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(DTYPES), st.lists(STEPS, max_size=4), st.sampled_from(DTYPES), st.integers(0, 2**31 - 1),
       st.booleans())
def test_cast_into_writes_the_bytes_of_cast_along(source, middle, wire, seed, offset_out):
    chain = (source, *middle, wire)
    value = torch.randn(6, 9, generator=torch.Generator().manual_seed(seed)).to(getattr(torch, source))
    expected = cast_along(value, chain).to(getattr(torch, wire))
    # `out` as the packed region gives it: a view into a larger buffer (offset), or a fresh tensor
    out = (torch.full((8, 9), float("nan"), dtype=getattr(torch, wire))[1:7] if offset_out
           else torch.empty(6, 9, dtype=getattr(torch, wire)))
    cast_into(out, value, chain)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8)), chain
