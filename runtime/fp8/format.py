"""The fp8 format the runtime quantizes to: float8_e4m3fn values in 128x128 blocks, one float32 scale per block."""

from __future__ import annotations

import torch

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0, what vLLM's get_fp8_min_max gives for e4m3fn (non-fnuz platforms)
