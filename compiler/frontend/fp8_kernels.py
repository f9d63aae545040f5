"""The fp8 kernel layout plans target; vllm_patches.triton_fp8_kernels makes vLLM choose it while compiling."""

from __future__ import annotations

from weightplan.runtime.fp8.rounding import ScaleRounding
from weightplan.runtime.plan.header import QuantLayout

# The kernel layout a plan targets: vLLM's Triton block-fp8 kernels, which keep the tensors
# exactly as per_block_cast_to_fp8 leaves them (no transpose, shuffle, padding or scale swizzle).
KERNEL_LAYOUT = QuantLayout(linear="TritonFp8BlockScaledMMKernel", moe="TRITON", block=(128, 128), weight_dtype="float8_e4m3fn",
                            scale_dtype="float32", layout="plain",
                            scale_rounding=ScaleRounding.CUDA)

