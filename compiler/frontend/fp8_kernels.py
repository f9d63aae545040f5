"""Stub only vLLM's fp8 kernel choice (not the quantization) so online fp8_per_block builds and processes on CPU."""

from __future__ import annotations

import contextlib

# The kernel layout a plan targets: vLLM's Triton block-fp8 kernels, which keep the tensors
# exactly as per_block_cast_to_fp8 leaves them (no transpose, shuffle, padding or scale swizzle).
KERNEL_LAYOUT = {
    "linear": "TritonFp8BlockScaledMMKernel",
    "moe": "TRITON",
    "block": [128, 128],
    "weight_dtype": "float8_e4m3fn",
    "scale_dtype": "float32",
    "layout": "plain",
}


class _NoExperts:
    """Stands for the MoE experts class; the MoE kernel is never built during a trace or a reference load."""


@contextlib.contextmanager
def triton_fp8_kernels():
    """Make vLLM pick the Triton block-fp8 linear kernel and the TRITON MoE backend, whatever the platform.

    On CPU, vLLM refuses every fp8 block kernel ("requires AMX tile support"). Those kernels only
    compute matmuls; the parameters they keep are set by process_weights_after_loading. The
    Triton kernels keep the plain layout, so choosing them here changes no parameter value; the
    MoE kernel object (only needed for forward) is not built.
    """
    from vllm.model_executor.kernels.linear.scaled_mm.triton import TritonFp8BlockScaledMMKernel
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import FP8ScaledMMLinearLayerConfig
    from vllm.model_executor.layers.fused_moe.oracle import fp8 as moe_oracle
    from vllm.model_executor.layers.quantization.online import fp8 as online_fp8

    def init_linear(activation_quant_key, weight_quant_key, input_dtype, out_dtype, weight_shape, force_kernel=None,
                    module_name=None):
        config = FP8ScaledMMLinearLayerConfig(weight_quant_key=weight_quant_key, activation_quant_key=activation_quant_key,
                                              input_dtype=input_dtype, out_dtype=out_dtype, weight_shape=weight_shape)
        return TritonFp8BlockScaledMMKernel(config)

    def select_moe(config, weight_key, activation_key, allow_vllm_cutlass=False):
        return moe_oracle.Fp8MoeBackend.TRITON, _NoExperts

    saved = [(online_fp8, "init_fp8_linear_kernel"), (online_fp8, "select_fp8_moe_backend"),
             (moe_oracle, "make_fp8_moe_kernel")]
    originals = [getattr(module, name) for module, name in saved]
    online_fp8.init_fp8_linear_kernel = init_linear
    online_fp8.select_fp8_moe_backend = select_moe
    moe_oracle.make_fp8_moe_kernel = lambda **kwargs: None
    try:
        yield
    finally:
        for (module, name), original in zip(saved, originals):
            setattr(module, name, original)
