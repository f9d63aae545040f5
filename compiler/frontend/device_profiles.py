"""The GPUs a plan can be traced for on a host without one (compile-plan --platform cuda --device NAME): what vLLM asks."""

from __future__ import annotations

from dataclasses import dataclass

from weightplan.runtime.errors import WeightplanError


class UnknownDevice(WeightplanError):
    """--device names no profile of PROFILES."""


@dataclass(frozen=True)
class DeviceProfile:
    """One GPU model as vLLM's CUDA platform would read it off the device (name, compute capability, memory, SMs)
    in an 8-GPU NVLink node. Only the capability changes what vLLM builds (attention backends, fp8 kernels and
    scale formats); the rest answers the platform's other questions with the real device's values."""

    name: str  # the --device name
    device_name: str  # torch.cuda.get_device_name
    capability: tuple[int, int]  # (major, minor): sm90 is (9, 0)
    total_memory: int  # bytes, nominal
    compute_units: int  # streaming multiprocessors
    gpus_per_node: int = 8
    nvlink: bool = True  # every GPU of the node reaches every other (vLLM's is_fully_connected)

    @property
    def capability_text(self) -> str:
        return f"{self.capability[0]}.{self.capability[1]}"

    @property
    def supports_pdl(self) -> bool:
        """Programmatic dependent launch: vLLM's `is_arch_support_pdl` is major >= 9."""
        return self.capability[0] >= 9


PROFILES = {p.name: p for p in (
    DeviceProfile("h100", "NVIDIA H100 80GB HBM3", (9, 0), 80 << 30, 132),
    DeviceProfile("h200", "NVIDIA H200", (9, 0), 141 * 10**9, 132),
    DeviceProfile("b200", "NVIDIA B200", (10, 0), 180 * 10**9, 148),
)}
DEFAULT_DEVICE = "h200"  # the seed cluster's GPU (docs/cuda.md)


def device_profile(name: str) -> DeviceProfile:
    """The profile called `name`; UnknownDevice (one line, naming the known ones) otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise UnknownDevice(f"unknown --device {name!r}; choose one of {', '.join(PROFILES)}") from None
