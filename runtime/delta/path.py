"""Which delta codec a side runs: the numba kernels on host memory, or the Triton kernels on the device its tensors are on."""

from __future__ import annotations

import torch

from ..errors import PlanMismatchError, WeightplanError

PATHS = ("auto", "host", "device")


def delta_path(tensors, path: str, side: str) -> tuple[str, torch.device]:
    """("host" | "device", where the codec's buffers live) for a side whose delta spaces or destinations are `tensors`.
    "auto": host for host tensors, device for tensors on one accelerator; "device" on host tensors runs the Triton
    kernels there (only under TRITON_INTERPRET=1: how tests prove them on a CPU)."""
    if path not in PATHS:
        raise WeightplanError(f"{side}: delta_path={path!r}; give one of {', '.join(PATHS)}")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise PlanMismatchError(f"{side}: delta syncs need every delta-served tensor on one device, these are on "
                                f"{', '.join(sorted(str(d) for d in devices))}")
    device = devices.pop() if devices else torch.device("cpu")
    if path == "host" and device.type != "cpu":
        raise PlanMismatchError(f"{side}: delta_path='host' needs host tensors, these are on {device}")
    chosen = "host" if path == "auto" and device.type == "cpu" else "device" if path == "auto" else path
    if chosen == "device":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise WeightplanError(f"{side}: delta syncs on {device} need triton (the device delta kernels); install it "
                                  "or keep the tensors on the host") from None
    else:
        try:
            import numba  # noqa: F401
        except ImportError:
            raise WeightplanError(f"{side}: delta syncs on host tensors need numba (the host delta kernels): install "
                                  "weightplan[host-kernels]") from None
    return chosen, device
