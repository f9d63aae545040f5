"""A reader's connection to one incarnation of a peer process: its info, its agent, the READs prepared from it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np
import torch

from ..errors import SyncError
from .memory import MemoryMap
from .protocol import Endpoint
from .reader import PeerReader, Transport
from .rendezvous import Rendezvous


class Peer:
    """Incarnation `incarnation` of `endpoint` as one reader sees it: `info` is its published info, read at
    construction; `load()` loads its agent once the caller checked that info; every list and READ prepared
    through it is released, and its agent removed, by `drop()`."""

    def __init__(self, agent: Transport, rendezvous: Rendezvous, endpoint: Endpoint, incarnation: str):
        self.endpoint, self.incarnation = endpoint, incarnation
        self.name = endpoint.agent(rendezvous.job)
        self.info = rendezvous.get_json(endpoint.info_key(incarnation))
        self._agent, self._rendezvous = agent, rendezvous
        # How its memory is read: its NIXL agent, or a LocalReader when it runs on this host (set before preparing).
        self.reader: PeerReader = agent
        self._handles: list = []  # (the reader that made it, the READ)
        self._lists: list = []  # (the reader that prepared it, the list)
        self.memory: MemoryMap | None = None  # where its registered memory lives (its info's 'memory'), set by load()

    def load(self, memory: MemoryMap | None = None, host: str | None = None) -> None:
        """Load its agent metadata, refusing metadata that names any other agent, once its info says where its memory
        lives (host or which GPU: the memory type of every descriptor on it; `memory`, parsed already, or its info's).
        `host`, its checked address, is named if it cannot be reached."""
        self.memory = memory if memory is not None else MemoryMap.from_record(self.info.get("memory"), str(self.endpoint))
        try:
            self._agent.add_peer(self._rendezvous.get_bytes(self.endpoint.metadata_key(self.incarnation)), self.name)
        except SyncError as exc:
            at = f" at {host}" if host else ""
            raise type(exc)(f"{self.endpoint}{at} (incarnation {self.incarnation[:8]}): {exc}") from None

    def prepare(self, rows: np.ndarray, local: bool = False, fields: dict[str, tuple[int, int]] | None = None):
        """A descriptor list of (address, bytes) rows on this peer (or, `local`, on the reader), released with it.

        Remote rows come from the peer's published info, `fields` ({info field: (address, bytes)}) naming the areas
        they lie in: memory the peer did not register is a SyncError naming the first such field."""
        reader = self._agent if local else self.reader
        try:
            prepared = reader.prepare(None if local else self.name, rows, self.memory)
        except Exception as exc:  # NIXL raises per-status types, e.g. nixlNotFoundError for memory the peer did not register
            if local:
                raise
            raise SyncError(f"{self.endpoint}: its info's {self._unregistered(fields or {}) or 'addresses'} name memory "
                            f"it did not register ({type(exc).__name__}); is that record its own?") from None
        self._lists.append((reader, prepared))
        return prepared

    def _unregistered(self, fields: dict[str, tuple[int, int]]) -> str:
        """The first field whose area alone the peer's memory does not hold (tried one at a time, on the error path)."""
        for name, (address, nbytes) in fields.items():
            try:
                self._lists.append((self.reader, self.reader.prepare(self.name, np.array([[address, nbytes]]), self.memory)))
            except Exception:  # noqa: BLE001 - the refusal is the answer
                return f"{name!r} ([{address:#x}, +{nbytes}))"
        return ""

    def reads(self, local, remote, rows: np.ndarray) -> list:
        """READs of descriptor rows `rows` of two prepared lists (PeerReader.make_reads), released with this peer."""
        handles = self.reader.make_reads(local, remote, rows)
        self._handles += [(self.reader, h) for h in handles]
        return handles

    def word(self, local, address: int, nbytes: int, field: str):
        """A READ of `nbytes` at `address` on this peer (its info's `field`: a sequence, ring or landed word) into the
        prepared `local`."""
        handle = self.reader.make_read(local, self.prepare(np.array([[address, nbytes]]), fields={field: (address, nbytes)}),
                                       np.zeros(1))
        self._handles.append((self.reader, handle))
        return handle

    def drop(self) -> None:
        for reader, handle in self._handles:
            reader.release(handle)
        for reader, prepared in self._lists:
            reader.release_list(prepared)
        if self.reader is not self._agent:
            self.reader.close()
        self._agent.remove_peer(self.name)


T = TypeVar("T")


class Connections(Generic[T]):
    """A reader's connection to each peer rank, made by `connect(rank, incarnation)` (an object with a `peer`) and
    made again when that rank runs a new incarnation (a restarted process)."""

    def __init__(self, connect: Callable[[int, str], T]):
        self._connect = connect
        self.by_rank: dict[int, T] = {}

    def to(self, rank: int, incarnation: str) -> T:
        """The connection to incarnation `incarnation` of `rank`, dropping one to an older incarnation first."""
        current = self.by_rank.get(rank)
        if current is not None and current.peer.incarnation == incarnation:
            return current
        if current is not None:
            self.drop(rank)
        self.by_rank[rank] = connection = self._connect(rank, incarnation)
        return connection

    def drop(self, rank: int) -> None:
        self.by_rank.pop(rank).peer.drop()

    def drop_all(self) -> None:
        for rank in list(self.by_rank):
            self.drop(rank)


def check_sequence(agent: PeerReader, seq_reads: dict[int, object], words: torch.Tensor, version: int, deadline: float,
                   what: str, unstable: Callable[[int, int], str]) -> None:
    """The seqlock check of a read: READ the sequence word of every trainer rank in `seq_reads` ({rank: its READ into
    words[rank]}); SyncError(unstable(rank, word)) for the first that does not hold `version` stable (2 * version)."""
    agent.read_now([(handle, f"trainer rank {rank}") for rank, handle in seq_reads.items()], deadline, what)
    for rank in seq_reads:
        seq = int(words[rank])
        if seq != 2 * version:
            raise SyncError(unstable(rank, seq))
