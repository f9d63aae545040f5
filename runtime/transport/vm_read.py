"""process_vm_readv through ctypes: copy byte ranges of another process on this host into this one, in batches the kernel takes whole."""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass

import numpy as np

IOV_MAX = 1024  # iovecs per call (Linux's UIO_MAXIOV)
# Linux moves at most MAX_RW_COUNT (2 GiB less a page) per call and returns a short count past it: batches stay under.
BATCH_BYTES = 1 << 30


class VmReadError(OSError):
    """A process_vm_readv that failed or moved fewer bytes than asked (its `errno`, 0 for a short read)."""


@dataclass(frozen=True)
class Batches:
    """(local address, remote address, bytes) pieces in calls: call k moves pieces [bounds[k], bounds[k + 1])."""

    local: np.ndarray  # uint64
    remote: np.ndarray  # uint64
    nbytes: np.ndarray  # uint64
    bounds: np.ndarray  # int64, starts with 0, ends with len(pieces)

    @property
    def total(self) -> int:
        return int(self.nbytes.sum())


def batches(local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray, max_iov: int = IOV_MAX,
            max_bytes: int = BATCH_BYTES) -> Batches:
    """Rows (local[i], remote[i], nbytes[i]) as calls of at most `max_iov` pieces and `max_bytes` bytes each, in row
    order: a row longer than `max_bytes` is cut into pieces; empty rows are dropped."""
    local, remote, nbytes = (np.asarray(a, dtype=np.uint64).reshape(-1) for a in (local, remote, nbytes))
    keep = nbytes > 0
    local, remote, nbytes = local[keep], remote[keep], nbytes[keep]
    cuts = ((nbytes + np.uint64(max_bytes - 1)) // np.uint64(max_bytes)).astype(np.int64)  # pieces per row
    row = np.repeat(np.arange(len(nbytes)), cuts)
    first = np.cumsum(cuts) - cuts
    at = (np.arange(len(row)) - first[row]).astype(np.uint64) * np.uint64(max_bytes)  # piece offset in its row
    size = np.minimum(nbytes[row] - at, np.uint64(max_bytes))
    bounds, start, used = [0], 0, 0
    for i, n in enumerate(size.tolist()):  # greedy: a call closes when the next piece would overflow it
        if i - start == max_iov or used + n > max_bytes:
            bounds.append(i)
            start, used = i, 0
        used += n
    if len(size):
        bounds.append(len(size))
    return Batches(local[row] + at, remote[row] + at, size, np.array(bounds, dtype=np.int64))


_libc = None


def _readv():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.process_vm_readv.restype = ctypes.c_ssize_t
        _libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                                           ctypes.c_ulong, ctypes.c_ulong]
    return _libc.process_vm_readv


def read(pid: int, plan: Batches) -> int:
    """Run every call of `plan` against process `pid`; returns the bytes moved, VmReadError at the first call that
    fails or comes back short (the process died, or the memory is no longer mapped)."""
    readv = _readv()
    local = np.stack([plan.local, plan.nbytes], axis=1)  # struct iovec {void *base; size_t len;} on 64-bit Linux
    remote = np.stack([plan.remote, plan.nbytes], axis=1)
    moved = 0
    for lo, hi in zip(plan.bounds[:-1].tolist(), plan.bounds[1:].tolist()):
        want = int(plan.nbytes[lo:hi].sum())
        got = readv(pid, local[lo:].ctypes.data, hi - lo, remote[lo:].ctypes.data, hi - lo, 0)
        if got < 0:
            code = ctypes.get_errno()
            raise VmReadError(code, os.strerror(code))
        if got != want:
            raise VmReadError(0, f"moved {got} of {want} bytes")
        moved += got
    return moved


def why(exc: VmReadError) -> str:
    """A short cause for a failed read, as a sync error names it."""
    if exc.errno == errno.ESRCH:
        return "its process is gone"
    if exc.errno in (errno.EPERM, errno.EACCES):
        return "not permitted to read its memory (ptrace access; kernel.yama.ptrace_scope)"
    if exc.errno == errno.EFAULT or exc.errno == 0:
        return "its memory is no longer mapped there"
    return exc.strerror or f"errno {exc.errno}"
