"""Reading a peer on this host without NIXL: its host memory with process_vm_readv, its CUDA memory opened over CUDA IPC."""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import SyncError, WeightplanError
from .local_record import PROBE_BYTES, CudaShare, HostId, LocalRecord
from .memory import VRAM, MemoryMap, group_rows, holding
from .nixl_agent import Backoff, NixlAgent, Prepared
from .vm_read import Batches, VmReadError, batches, read, why

HOST_READ, CUDA_READ = "process_vm_readv", "cuda_ipc"  # path names in SyncReport.paths
BOUNCE_BYTES = 64 << 20  # host memory read on its way into a GPU, per step
UNSIGNED = ("this job has no secret, so any local process could have written the trainers' records (same-node reads "
            "need WEIGHTPLAN_SECRET_FILE or WEIGHTPLAN_SECRET)")


class NotLocal(Exception):
    """Why a peer's memory cannot be read from this process directly: the caller reads it over NIXL instead."""


@dataclass(frozen=True)
class Registered:
    """What bounds a LocalReader: the memory peer `peer` registered with NIXL, as `agent` (this process's NIXL agent)
    loaded it from the peer's metadata, not as its info says: NIXL prepares descriptors on a peer only inside it."""

    agent: NixlAgent
    peer: str

    def refuses(self, rows: np.ndarray, memory: MemoryMap) -> str | None:
        """None when the peer registered every (address, bytes) row, else why NIXL refuses them."""
        try:
            self.agent.release_list(self.agent.prepare(self.peer, np.asarray(rows).reshape(-1, 2), memory))
        except SyncError as exc:
            return str(exc)
        except Exception as exc:  # NIXL raises per-status types: nixlNotFoundError for memory the peer did not register
            return f"{type(exc).__name__}: not memory it registered"
        return None


def _identity(record: LocalRecord, incarnation: bytes) -> str | None:
    """None while process `record.pid` holds `incarnation` at its probe (so that pid still names the trainer), else
    why not: a trainer that exited, or whose pid now names another process, fails this check."""
    probe = np.zeros(PROBE_BYTES, dtype=np.uint8)
    try:
        read(record.pid, batches([probe.ctypes.data], [record.probe], [PROBE_BYTES]))
    except VmReadError as exc:
        return f"process_vm_readv of its process {record.pid}: {why(exc)}"
    if probe.tobytes() != incarnation:
        return f"process {record.pid} of this host does not hold its incarnation at its probe"
    return None


@dataclass(frozen=True)
class Storages:
    """Byte views of CUDA (or host) storages, by address: which one holds a row, and at what offset."""

    starts: np.ndarray  # uint64, sorted
    ends: np.ndarray
    views: tuple[torch.Tensor, ...]  # uint8, one per storage, in `starts` order

    @classmethod
    def of(cls, pairs: list[tuple[int, torch.Tensor]]) -> "Storages":
        pairs = sorted(pairs, key=lambda p: p[0])
        return cls(np.array([a for a, _ in pairs], dtype=np.uint64),
                   np.array([a + v.numel() for a, v in pairs], dtype=np.uint64), tuple(v for _, v in pairs))

    @classmethod
    def local(cls, tensors: list[torch.Tensor]) -> "Storages":
        """The storages of this process's registered tensors (views of one storage counted once)."""
        seen = {}
        for t in tensors:
            if t.numel():
                s = t.untyped_storage()
                seen.setdefault(s.data_ptr(), torch.empty(0, dtype=torch.uint8, device=t.device).set_(s))
        return cls.of(list(seen.items()))

    def locate(self, address: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """The storage holding each row whole, -1 where none does."""
        return holding(self.starts, self.ends, address, nbytes)


@dataclass(frozen=True)
class LocalPrepared:
    """Rows on the peer as a LocalReader prepared them: (address, bytes) and the opened CUDA storage of each (-1: host)."""

    reader: "LocalReader"
    table: np.ndarray
    storage: np.ndarray


@dataclass(frozen=True)
class LocalRead:
    """One READ as local copies: host rows in process_vm_readv calls (`host`), rows of the peer's CUDA memory as device
    copies of coalesced runs (`copies`: (destination view, source view)), host rows into device memory (`bounced`)."""

    reader: "LocalReader"
    host: Batches | None
    copies: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    bounced: tuple[np.ndarray, np.ndarray, tuple[torch.Tensor, ...]] | None  # remote addresses, bytes, destination views
    nbytes: int


def _runs(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, same: np.ndarray) -> np.ndarray:
    """Starts of runs of rows that continue each other on both sides within one pair of storages (`same[i]`: row i
    lies in the storages row i - 1 does)."""
    if not len(dst):
        return np.zeros(0, dtype=np.int64)
    follows = (dst[1:] == dst[:-1] + nbytes[:-1]) & (src[1:] == src[:-1] + nbytes[:-1]) & same[1:]
    return np.flatnonzero(np.concatenate([[True], ~follows]))


class LocalReader:
    """Reads one peer process on this host (`record`, checked by `open_local`): the same calls as a NixlAgent's reads.

    Rows are prepared only inside the memory the peer registered with NIXL (`registered`), and every READ is posted only
    once the process still holds the peer's `incarnation` at its probe. Host rows are copied by process_vm_readv when
    posted; CUDA rows are queued as device copies on the current stream when posted and waited for (an event per READ)
    by `wait`, so a READ is complete when `wait` returns, as over NIXL."""

    def __init__(self, record: LocalRecord, memory: MemoryMap, shared: Storages, local: Storages, name: str,
                 registered: Registered, incarnation: bytes):
        self.record, self.memory, self.name = record, memory, name
        self.registered, self.incarnation = registered, incarnation
        self._shared, self._local = shared, local
        self._events: dict[int, list] = {}
        self._bounce: torch.Tensor | None = None

    @property
    def path(self) -> str:
        return CUDA_READ if len(self._shared.views) else HOST_READ

    def path_bytes(self, memory: MemoryMap, rows: np.ndarray) -> dict[str, int]:
        """{path: bytes} READing (address, bytes) rows of the peer moves: rows in its GPU memory over CUDA IPC, the
        others with process_vm_readv."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
        where = memory.locate(rows)
        device = np.array([p.kind == VRAM for p in memory.placements] + [False])[where]
        out = {CUDA_READ: int(rows[device, 1].sum()), HOST_READ: int(rows[~device, 1].sum())}
        return {k: v for k, v in out.items() if v}

    def prepare(self, peer: str | None, rows: np.ndarray, memory: MemoryMap | None = None) -> LocalPrepared:
        """Rows on the peer, each inside its published memory and inside what it registered with NIXL (SyncError
        naming the first that is not, or NIXL's refusal): `peer` is always this reader's peer."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
        try:
            groups = group_rows(self.memory, rows)
        except ValueError as exc:
            raise SyncError(f"{self.name}: a descriptor {exc} of that process (its info's 'memory')") from None
        refused = self.registered.refuses(rows, self.memory) if len(rows) else None
        if refused is not None:
            raise SyncError(f"{self.name}: NIXL refuses descriptors this process would read directly ({refused})")
        device = np.array([p.kind == VRAM for p in groups.placements] + [False], dtype=bool)
        on_device = device[groups.group] if len(rows) else np.zeros(0, dtype=bool)
        storage = np.where(on_device, self._shared.locate(rows[:, 0], rows[:, 1]), -1)
        if (on_device & (storage < 0)).any():  # open_local checked every device span: only a bug gets here
            raise WeightplanError(f"{self.name}: device memory at {int(rows[on_device & (storage < 0)][0, 0]):#x} lies in "
                                  "no storage opened over CUDA IPC")
        return LocalPrepared(self, rows, storage)

    def make_read(self, local: Prepared, remote: LocalPrepared, indices: np.ndarray, message: bytes = b"") -> LocalRead:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        dst, src = local.table[idx].astype(np.int64), remote.table[idx]
        nbytes, storage = src[:, 1].astype(np.uint64), remote.storage[idx]
        on_device = np.array([p.kind == VRAM for p in local.rows.placements] + [False], dtype=bool)
        into_device = on_device[local.rows.group[idx]] if len(idx) else np.zeros(0, dtype=bool)
        host = (storage < 0) & ~into_device
        plan = batches(dst[host, 0], src[host, 0], nbytes[host]) if host.any() else None
        copies = self._copies(dst[storage >= 0, 0], src[storage >= 0, 0], nbytes[storage >= 0], storage[storage >= 0])
        bounce = (storage < 0) & into_device
        bounced = None
        if bounce.any():
            views = self._local_views(dst[bounce, 0], nbytes[bounce])
            bounced = (src[bounce, 0].astype(np.uint64), nbytes[bounce], views)
        return LocalRead(self, plan, copies, bounced, int(nbytes.sum()))

    def make_reads(self, local, remote, rows: np.ndarray) -> list:
        return [self.make_read(local, remote, rows)] if len(rows) else []

    def _local_views(self, address: np.ndarray, nbytes: np.ndarray) -> tuple[torch.Tensor, ...]:
        at = self._local.locate(address, nbytes)
        if (at < 0).any():
            raise WeightplanError(f"{self.name}: local memory at {int(address[at < 0][0]):#x} is not registered here")
        return tuple(self._local.views[s][a - int(self._local.starts[s]) : a - int(self._local.starts[s]) + n]
                     for s, a, n in zip(at.tolist(), address.tolist(), nbytes.tolist()))

    def _copies(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, storage: np.ndarray) -> tuple:
        """Device copies of rows from opened storages, one per run of rows that continue each other on both sides."""
        if not len(dst):
            return ()
        mine = self._local.locate(dst, nbytes)
        if (mine < 0).any():
            raise WeightplanError(f"{self.name}: local memory at {int(dst[mine < 0][0]):#x} is not registered here")
        same = np.concatenate([[False], (mine[1:] == mine[:-1]) & (storage[1:] == storage[:-1])])
        starts = _runs(dst, src.astype(np.int64), nbytes.astype(np.int64), same)
        sizes = np.add.reduceat(nbytes.astype(np.int64), starts)
        out = []
        for i, n in zip(starts.tolist(), sizes.tolist()):
            d, s = int(dst[i] - self._local.starts[mine[i]]), int(src[i] - self._shared.starts[storage[i]])
            out.append((self._local.views[mine[i]][d : d + n], self._shared.views[storage[i]][s : s + n]))
        return tuple(out)

    def post(self, handle: LocalRead, peer: str) -> None:
        lost = _identity(self.record, self.incarnation)
        if lost is not None:
            raise SyncError(f"{peer}: {lost}: that trainer exited, or its pid names another process now")
        try:
            if handle.host is not None:
                read(self.record.pid, handle.host)
            if handle.bounced is not None:
                self._bounce_in(*handle.bounced)
        except VmReadError as exc:
            raise SyncError(f"posting a READ from {peer} failed: {why(exc)} (did that process die?)") from None
        if handle.copies:
            with torch.no_grad():
                for dst, src in handle.copies:
                    dst.copy_(src, non_blocking=True)
            events = []
            for device in {src.device for _, src in handle.copies} | {dst.device for dst, _ in handle.copies if dst.is_cuda}:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                events.append(event)
            self._events[id(handle)] = events

    def _bounce_in(self, remote: np.ndarray, nbytes: np.ndarray, views: tuple[torch.Tensor, ...]) -> None:
        """Host rows into device memory: read into a pinned buffer BOUNCE_BYTES at a time, copied on from there."""
        if self._bounce is None:
            self._bounce = torch.empty(BOUNCE_BYTES, dtype=torch.uint8, pin_memory=True)
        base = self._bounce.data_ptr()
        for view, address, n in zip(views, remote.tolist(), nbytes.tolist()):
            for at in range(0, n, BOUNCE_BYTES):
                size = min(BOUNCE_BYTES, n - at)
                read(self.record.pid, batches([base], [address + at], [size]))
                view[at : at + size].copy_(self._bounce[:size], non_blocking=True)
                torch.cuda.current_stream(view.device).synchronize()  # before the buffer is read into again

    def wait(self, handles: list[tuple[object, str]], deadline: float, what: str) -> dict[str, float]:
        """Wait until the device copies of every posted (READ, peer) finished; the deadline raises SyncError."""
        done_at = {peer: time.monotonic() for _, peer in handles}
        backoff = Backoff()
        for handle, peer in handles:
            for event in self._events.pop(id(handle), ()):
                while not event.query():
                    if time.monotonic() > deadline:
                        raise SyncError(f"{what}: timed out waiting for READs from {peer}")
                    backoff.sleep()
            done_at[peer] = time.monotonic()
        return done_at

    def read_now(self, handles: list[tuple[object, str]], deadline: float, what: str) -> None:
        for handle, peer in handles:
            self.post(handle, peer)
        self.wait(handles, deadline, what)

    def release(self, handle: LocalRead) -> None:
        self._events.pop(id(handle), None)

    def release_list(self, prepared: LocalPrepared) -> None:
        """Nothing to release: the opened storages live as long as this reader."""

    def close(self) -> None:
        """Drop the opened CUDA storages (torch closes their IPC mappings once unused)."""
        self._shared = Storages.of([])
        self._events.clear()
        self._bounce = None


def _device_of(uuid: str) -> int:
    """The index of this process's CUDA device whose uuid is `uuid`; NotLocal when it sees none."""
    if not torch.cuda.is_available():
        raise NotLocal("this process has no CUDA device to open the trainer's GPU memory on")
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise NotLocal(f"this process sees no GPU with uuid {uuid}")


def _allocation(pointer: int, device: int) -> tuple[int, int] | None:
    """(start, bytes) of the CUDA allocation that holds device address `pointer` in this process, as the driver maps it
    (cuMemGetAddressRange); None when it cannot say."""
    try:
        get = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    except (OSError, AttributeError):
        return None
    get.restype = ctypes.c_int
    get.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    start, size = ctypes.c_uint64(), ctypes.c_size_t()
    with torch.cuda.device(device):
        status = get(ctypes.byref(start), ctypes.byref(size), pointer)
    return (start.value, size.value) if status == 0 else None


def beyond_allocation(share: CudaShare, base: int, allocation: tuple[int, int] | None) -> str | None:
    """Why the storage `share` names does not lie inside the allocation its handle opened at `base` (torch adds the
    share's offset to `base` and trusts its size: a storage past the allocation faults the first copy), None if it does."""
    if allocation is None:
        return f"the driver cannot bound the allocation of its storage at {share.address:#x}"
    start, size = allocation
    if start != base or share.offset + share.nbytes > size:
        return (f"its storage at {share.address:#x} ({share.nbytes} bytes at offset {share.offset}) does not lie in the "
                f"allocation of {size} bytes its handle opened")
    return None


def open_local(record: LocalRecord, memory: MemoryMap, incarnation: str, registered: list[torch.Tensor],
               name: str, bound: Registered) -> LocalReader:
    """A LocalReader of the peer `record` describes, once it is on this host, its probe lies in memory it registered
    with NIXL (`bound`) and its process holds `incarnation` there (so the pid is that process, not another one in
    another pid namespace), and every GPU span of its `memory` lies in a storage opened here inside its allocation;
    NotLocal(why) otherwise."""
    if record.host != HostId.here():
        raise NotLocal("it runs on another host")
    refused = bound.refuses(np.array([[record.probe, PROBE_BYTES]]), memory)
    if refused is not None:
        raise NotLocal(f"its probe at {record.probe:#x} is not memory it registered with NIXL ({refused})")
    lost = _identity(record, bytes.fromhex(incarnation))
    if lost is not None:
        raise NotLocal(lost)
    opened = []
    for share in record.cuda:
        device = _device_of(share.uuid)
        try:
            storage = share.open(device)
        except (RuntimeError, TypeError) as exc:
            raise NotLocal(f"CUDA IPC refused its storage at {share.address:#x}: {str(exc).splitlines()[0][:120]}") from None
        if storage.nbytes() != share.nbytes:
            raise NotLocal(f"its storage at {share.address:#x} opened with {storage.nbytes()} bytes, not {share.nbytes}")
        base = storage.data_ptr() - share.offset  # where the handle's allocation opened here
        outside = beyond_allocation(share, base, _allocation(base, device))
        if outside is not None:
            raise NotLocal(outside)
        opened.append((share.address, torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)))
    shared = Storages.of(opened)
    device = [s for s in memory.spans() if s.placement.kind == VRAM]
    if device:
        inside = shared.locate(np.array([s.address for s in device]), np.array([s.nbytes for s in device]))
        if (inside < 0).any():
            raise NotLocal(f"its GPU memory at {device[int(np.flatnonzero(inside < 0)[0])].address:#x} has no CUDA IPC handle")
    return LocalReader(record, memory, shared, Storages.local(registered), name, bound, bytes.fromhex(incarnation))
