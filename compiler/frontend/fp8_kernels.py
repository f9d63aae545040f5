"""The fp8 kernel layout plans target: vLLM's Triton kernels on CPU (vllm_patches.triton_fp8_kernels), its own choice on CUDA."""

from __future__ import annotations

from weightplan.runtime.fp8.rounding import ScaleRounding
from weightplan.runtime.plan.header import QuantLayout

# The kernel layout a plan targets: vLLM's Triton block-fp8 kernels, which keep the tensors
# exactly as per_block_cast_to_fp8 leaves them (no transpose, shuffle, padding or scale swizzle).
# A cuda plan names the kernels vLLM chose instead (cuda_platform.traced_fp8_kernels); the trace refuses
# any whose parameters are not this plain layout (fp8_trace.trace_post_load).
KERNEL_LAYOUT = QuantLayout(linear="TritonFp8BlockScaledMMKernel", moe="TRITON", block=(128, 128), weight_dtype="float8_e4m3fn",
                            scale_dtype="float32", layout="plain",
                            scale_rounding=ScaleRounding.CUDA)

