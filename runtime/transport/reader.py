"""The transport seam: what a Receiver needs of a reader of a peer's registered memory, and the router between readers."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from .local_peer import LocalPrepared, LocalRead
from .memory import MemoryMap


@runtime_checkable
class PeerReader(Protocol):
    """Prepare descriptor rows once, make READs of them once, post and wait for those READs every sync.

    NixlAgent is one (one-sided NIXL/UCX READs, any host); runtime/transport/local_peer.py's LocalReader another (a
    peer on this host, read by process_vm_readv and CUDA IPC). A READ is complete when `wait` returns; a peer that
    died or a deadline passed is a SyncError, whichever reader it was."""

    def prepare(self, peer: str | None, rows: np.ndarray, memory: MemoryMap | None = None): ...

    def make_read(self, local, remote, indices: np.ndarray, message: bytes = b""): ...

    def make_reads(self, local, remote, rows: np.ndarray) -> list: ...

    def post(self, handle, peer: str) -> None: ...

    def wait(self, handles: list[tuple[object, str]], deadline: float, what: str) -> dict[str, float]: ...

    def read_now(self, handles: list[tuple[object, str]], deadline: float, what: str) -> None: ...

    def release(self, handle) -> None: ...

    def release_list(self, prepared) -> None: ...

    def path_bytes(self, memory: MemoryMap, rows: np.ndarray) -> dict[str, int]: ...


@runtime_checkable
class Transport(PeerReader, Protocol):
    """A process's own transport: a PeerReader that also registers its memory, publishes metadata peers load, loads
    theirs and carries notifications. NixlAgent is the one there is; a second (a fake in tests, another fabric) is one
    new class with these members (tests/runtime/test_transport_interface.py holds NixlAgent to this declaration)."""

    name: str
    path: str  # its name in SyncReport.paths
    memory: MemoryMap  # what it registered, by placement

    def register(self, tensors: list) -> None: ...

    def metadata(self) -> bytes: ...

    def close(self) -> None: ...

    def background(self, on: bool) -> None: ...

    @property
    def closed(self) -> bool: ...

    def add_peer(self, metadata: bytes, expected_name: str) -> None: ...

    def remove_peer(self, name: str) -> None: ...

    def notify(self, peer: str, message: str) -> None: ...

    def flush(self, seconds: float) -> None: ...

    def notifications(self) -> dict[str, list[str]]: ...

    @property
    def links_changed(self) -> bool: ...  # this host's network links differ from those it was made with (links.py)


class Routed:
    """A PeerReader over READs of several readers: each list and READ goes to the reader that made it (a LocalReader's
    carry it), every other to the NIXL agent, which also prepares this process's own rows (peer None)."""

    def __init__(self, agent: Transport):
        self.agent = agent

    def _of(self, made) -> PeerReader:
        return made.reader if isinstance(made, (LocalPrepared, LocalRead)) else self.agent

    def prepare(self, peer: str | None, rows: np.ndarray, memory: MemoryMap | None = None):
        return self.agent.prepare(peer, rows, memory)

    def make_read(self, local, remote, indices: np.ndarray, message: bytes = b""):
        return self._of(remote).make_read(local, remote, indices, message)

    def make_reads(self, local, remote, rows: np.ndarray) -> list:
        return self._of(remote).make_reads(local, remote, rows)

    def post(self, handle, peer: str) -> None:
        self._of(handle).post(handle, peer)

    def wait(self, handles: list[tuple[object, str]], deadline: float, what: str) -> dict[str, float]:
        """Wait for each reader's READs in turn (every deadline is the same): done times by peer, the latest seen."""
        by_reader: dict[int, tuple[PeerReader, list]] = {}
        for handle, peer in handles:
            reader = self._of(handle)
            by_reader.setdefault(id(reader), (reader, []))[1].append((handle, peer))
        done_at: dict[str, float] = {}
        for reader, mine in by_reader.values():
            for peer, at in reader.wait(mine, deadline, what).items():
                done_at[peer] = max(done_at.get(peer, at), at)
        return done_at

    def read_now(self, handles: list[tuple[object, str]], deadline: float, what: str) -> None:
        for handle, peer in handles:
            self.post(handle, peer)
        self.wait(handles, deadline, what)

    def release(self, handle) -> None:
        self._of(handle).release(handle)

    def release_list(self, prepared) -> None:
        self._of(prepared).release_list(prepared)

    def path_bytes(self, memory: MemoryMap, rows: np.ndarray) -> dict[str, int]:
        return self.agent.path_bytes(memory, rows)
