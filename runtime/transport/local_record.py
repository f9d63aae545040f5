"""What a trainer publishes so that a reader on its host can open its registered memory (its info's 'local'): built, encoded and parsed here."""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass

import torch

from ..errors import SyncError
from .memory import ADDRESS_LIMIT, check_area

log = logging.getLogger("weightplan.runtime")

MAX_SHARES = 1 << 16  # CUDA storages a record may list: a rank registers a few dozen
MAX_HANDLE_BYTES = 256  # a cudaIpcMemHandle is 64 bytes, torch's ref-counter handle a short shared-memory file name
MAX_PID = 1 << 22  # Linux's pid_max limit
PROBE_BYTES = 16  # the incarnation's 16 bytes, held at the probe address of the trainer's process
# torch's CUDA IPC ref-counter files hold this many int64 counters (CUDA_IPC_REF_COUNTER_FILE_SIZE,
# torch/csrc/CudaIPCTypes.h); a reader dropping an opened storage decrements counter `ref_offset` of file `ref_counter`.
REF_COUNTERS = 10000
_BOOT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_HOSTNAME = re.compile(r"[A-Za-z0-9._-]{1,255}")
_UUID = re.compile(r"[A-Za-z0-9-]{1,64}")


@dataclass(frozen=True)
class HostId:
    """One boot of one machine: the kernel's boot_id and the hostname (both must match: containers share the former)."""

    boot_id: str
    hostname: str

    @classmethod
    def here(cls) -> "HostId":
        with open("/proc/sys/kernel/random/boot_id") as f:
            return cls(f.read().strip(), socket.gethostname())


@dataclass(frozen=True)
class CudaShare:
    """One CUDA storage of the trainer as torch's `UntypedStorage._share_cuda_()` exports it: the storage's bytes
    [address, address + nbytes) in the trainer's process, on the GPU `uuid` (device index `device` there), opened
    elsewhere with `UntypedStorage._new_shared_cuda`."""

    address: int
    nbytes: int
    uuid: str
    device: int
    handle: bytes
    offset: int  # of the storage in the CUDA allocation `handle` names
    ref_counter: bytes
    ref_offset: int
    event: bytes
    event_sync: bool

    def record(self) -> dict:
        return {"address": self.address, "bytes": self.nbytes, "uuid": self.uuid, "device": self.device,
                "handle": self.handle.hex(), "offset": self.offset, "ref_counter": self.ref_counter.hex(),
                "ref_offset": self.ref_offset, "event": self.event.hex(), "event_sync": self.event_sync}

    @classmethod
    def of(cls, storage: torch.UntypedStorage) -> "CudaShare":
        device, handle, nbytes, offset, ref_counter, ref_offset, event, event_sync = storage._share_cuda_()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        return cls(storage.data_ptr(), int(nbytes), uuid, int(device), bytes(handle), int(offset), bytes(ref_counter),
                   int(ref_offset), bytes(event or b""), bool(event_sync))

    def open(self, device: int) -> torch.UntypedStorage:
        """This storage opened in this process on local device `device` (the one whose uuid is `uuid`)."""
        return torch.UntypedStorage._new_shared_cuda(device, self.handle, self.nbytes, self.offset, self.ref_counter,
                                                     self.ref_offset, self.event, self.event_sync)


@dataclass(frozen=True)
class LocalRecord:
    """A trainer process as a reader on its host opens it: its host, its pid (host memory is read with
    process_vm_readv), the address of its probe (PROBE_BYTES bytes holding its incarnation, which a reader checks
    before trusting the pid) and its CUDA storages."""

    host: HostId
    pid: int
    probe: int
    cuda: tuple[CudaShare, ...]

    def record(self) -> dict:
        return {"host": {"boot_id": self.host.boot_id, "hostname": self.host.hostname}, "pid": self.pid,
                "probe": [self.probe, PROBE_BYTES], "cuda": [s.record() for s in self.cuda]}


def local_record(tensors: list[torch.Tensor], probe: torch.Tensor) -> LocalRecord:
    """The record of this process, with one share per distinct CUDA storage among `tensors`. A storage torch cannot
    share (memory from another allocator) is left out: readers then find a device span no share covers and use NIXL."""
    shares, seen = [], set()
    for t in tensors:
        if t.device.type != "cuda" or not t.numel():
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        try:
            shares.append(CudaShare.of(storage))
        except (RuntimeError, TypeError) as exc:
            log.info("a CUDA storage at %#x cannot be shared over CUDA IPC (%s); same-host readers will use NIXL",
                     storage.data_ptr(), exc)
    return LocalRecord(HostId.here(), os.getpid(), probe.data_ptr(), tuple(shares))


def _int(value, field: str, who: str, upper: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < upper:
        raise SyncError(f"{who}: its info's '{field}' is {str(value)[:40]}, expected an integer in [0, {upper})")
    return value


def _pid(value, who: str) -> int:
    if _int(value, "local.pid", who, MAX_PID) == 0:
        raise SyncError(f"{who}: its info's 'local.pid' is 0, not a process")
    return value


def _hex(value, field: str, who: str) -> bytes:
    if not isinstance(value, str) or len(value) > 2 * MAX_HANDLE_BYTES or not re.fullmatch(r"(?:[0-9a-f]{2})*", value):
        raise SyncError(f"{who}: its info's '{field}' is not hex of at most {MAX_HANDLE_BYTES} bytes")
    return bytes.fromhex(value)


def _text(value, pattern: re.Pattern, field: str, who: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise SyncError(f"{who}: its info's '{field}' is {str(value)[:40]!r}, not a valid {field.rsplit('.', 1)[-1]}")
    return value


_SHARE_FIELDS = ("address", "bytes", "uuid", "device", "handle", "offset", "ref_counter", "ref_offset", "event",
                 "event_sync")


def _ref_counter(value, field: str, who: str, pid: int) -> bytes:
    """A ref-counter file name as torch names those of process `pid` (at::NewProcessWideShmHandle:
    /torch_<getpid()>_<a random 32-bit number>_<a counter>), so a dropped storage decrements no other file."""
    name = _hex(value, field, who)
    if not re.fullmatch(rb"/torch_%d_[0-9]{1,10}_[0-9]{1,20}" % pid, name):
        raise SyncError(f"{who}: its info's '{field}' is {name[:40]!r}, not a ref-counter file torch names for process {pid}")
    return name


def parse_share(value, field: str, who: str, pid: int) -> CudaShare:
    """A CudaShare of process `pid` from its record at `field` of `who`'s info, within torch's own bounds (a counter inside
    one of that process's ref-counter files); SyncError naming the field otherwise."""
    if not isinstance(value, dict) or set(value) != set(_SHARE_FIELDS):
        raise SyncError(f"{who}: its info's '{field}' is not an object of {', '.join(_SHARE_FIELDS)}")
    address = _int(value["address"], f"{field}.address", who, ADDRESS_LIMIT)
    nbytes = check_area(address, value["bytes"], f"{field}.bytes", who)[1]
    if not isinstance(value["event_sync"], bool):
        raise SyncError(f"{who}: its info's '{field}.event_sync' is not a boolean")
    return CudaShare(address, nbytes, _text(value["uuid"], _UUID, f"{field}.uuid", who),
                     _int(value["device"], f"{field}.device", who, 1 << 16), _hex(value["handle"], f"{field}.handle", who),
                     _int(value["offset"], f"{field}.offset", who, ADDRESS_LIMIT - nbytes),
                     _ref_counter(value["ref_counter"], f"{field}.ref_counter", who, pid),
                     _int(value["ref_offset"], f"{field}.ref_offset", who, REF_COUNTERS),
                     _hex(value["event"], f"{field}.event", who), value["event_sync"])


def parse_local(value, who: str) -> LocalRecord | None:
    """The LocalRecord of `who`'s info field 'local' (None when absent); SyncError naming the malformed field."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"host", "pid", "probe", "cuda"}:
        raise SyncError(f"{who}: its info's 'local' is not an object of host, pid, probe, cuda")
    host = value["host"]
    if not isinstance(host, dict) or set(host) != {"boot_id", "hostname"}:
        raise SyncError(f"{who}: its info's 'local.host' is not an object of boot_id, hostname")
    probe = value["probe"]
    if not isinstance(probe, list) or len(probe) != 2 or probe[1] != PROBE_BYTES:
        raise SyncError(f"{who}: its info's 'local.probe' is not [address, {PROBE_BYTES}]")
    cuda = value["cuda"]
    if not isinstance(cuda, list) or len(cuda) > MAX_SHARES:
        raise SyncError(f"{who}: its info's 'local.cuda' is not a list of at most {MAX_SHARES} CUDA storages")
    pid = _pid(value["pid"], who)
    return LocalRecord(HostId(_text(host["boot_id"], _BOOT_ID, "local.host.boot_id", who),
                              _text(host["hostname"], _HOSTNAME, "local.host.hostname", who)),
                       pid, check_area(probe[0], PROBE_BYTES, "local.probe", who)[0],
                       tuple(parse_share(s, f"local.cuda[{i}]", who, pid) for i, s in enumerate(cuda)))
