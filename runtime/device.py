"""Ordering between device work and the sync protocol: wait for the kernels that produce or consume a rank's tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch


class Stream(Protocol):
    """What DeviceSync needs of a device stream (torch.cuda.Stream, or a test's recording fake)."""

    def synchronize(self) -> None: ...


def cuda_devices(tensors: Iterable[torch.Tensor | None]) -> tuple[torch.device, ...]:
    """The distinct CUDA devices the tensors live on, in index order (host tensors need no device wait)."""
    found = {t.device for t in tensors if t is not None and t.device.type == "cuda"}
    return tuple(sorted(found, key=lambda d: -1 if d.index is None else d.index))


class _WholeDevice:
    def __init__(self, device: torch.device):
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def whole_device(device: torch.device) -> list[Stream]:
    """Every stream of the device at once (torch.cuda.synchronize): a trainer's optimizer may run its kernels on a side
    stream, and a tensor does not say which stream last wrote it. The Sender waits this way."""
    return [_WholeDevice(device)]


def current_stream(device: torch.device) -> list[Stream]:
    """The device's current stream, where the runtime's own kernels (quantization, derived state, constants) run. The
    Receiver waits this way: waiting for the whole device would also wait for the engine's serving kernels."""
    return [torch.cuda.current_stream(device)]


class DeviceSync:
    """Waits until the device work queued so far on `devices` finished, before the protocol step that exposes or
    hands over their bytes (a Sender's sequence word and version record, a Receiver's landed word, ack and version).

    `streams(device)` gives what to wait on per device: `whole_device` (default) or `current_stream`. A rank whose
    tensors are all in host memory has no devices and waits for nothing. `calls` counts waits, by reason.
    """

    def __init__(self, devices: tuple[torch.device, ...], streams: Callable[[torch.device], list[Stream]] = whole_device):
        self.devices = devices
        self._streams = streams
        self.calls: list[str] = []

    @classmethod
    def of(cls, tensors: Iterable[torch.Tensor | None], streams: Callable[[torch.device], list[Stream]] = whole_device
           ) -> "DeviceSync":
        return cls(cuda_devices(tensors), streams)

    def wait(self, why: str) -> None:
        """Block until every stream of every device finished what was queued on it; `why` names the protocol step."""
        if not self.devices:
            return
        self.calls.append(why)
        for device in self.devices:
            for stream in self._streams(device):
                stream.synchronize()
