"""A trainer's gather-side READs at publish: the bf16 its peers hold of the blocks it quantizes, read once per version."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import SyncError
from ..plan.format import Plan
from ..tables.quant import QuantTables, exposed_regions, region_index
from ..transport.nixl_agent import NixlAgent, contiguous_starts
from ..transport.peer_check import checked_regions, checked_word
from ..transport.rendezvous import INCARNATION, Rendezvous, trainer_agent


def staged_key(rank: int, version: int) -> str:
    """Trainer `rank`'s bf16 for `version` is exposed and stable (its sequence word reads 2 * version)."""
    return f"trainer/{rank}/staged/{version}"


def gathered_key(rank: int, version: int) -> str:
    """Trainer `rank` finished reading its peers' bytes of `version`; they may release it."""
    return f"trainer/{rank}/gathered/{version}"


@dataclass
class _Peer:
    incarnation: str
    agent: str
    reads: list
    seq_read: object
    lists: list


class TrainerGather:
    """Trainer `rank`'s READs of its gather-side stage copies from peer trainer ranks into one bf16 `buffer`.

    Copy i of `tables.gathered(rank)` lands at element `offset[i]`. At every publish the peers'
    bytes are read after they announce `staged_key` and between two reads of their sequence word,
    which must say the version is stable both times (the same seqlock the receivers use), so a
    peer that moved on cannot leave mixed bytes in a block this rank serves as fp8.
    """

    def __init__(self, plan: Plan, rank: int, tables: QuantTables):
        self.plan, self.rank, self.tables = plan, rank, tables
        self.rows = tables.gathered(rank)
        c = tables.copies.take(self.rows)
        self.offset = np.cumsum(c.length) - c.length
        self.buffer = torch.empty(int(c.length.sum()), dtype=torch.bfloat16)
        self.peers = tuple(sorted(set(c.src_rank.tolist())))
        self._copies = c
        self._seq = torch.zeros(plan.header.src_ranks, dtype=torch.int64)
        self._connected: dict[int, _Peer] = {}
        self.seconds = 0.0
        self.wait_seconds = 0.0  # of `seconds`: waiting for the peers to stage the version

    @property
    def registered(self) -> list[torch.Tensor]:
        return [self.buffer, self._seq]

    def fetch(self, agent: NixlAgent, rendezvous: Rendezvous, version: int, deadline: float) -> float:
        """READ this version's bytes from every peer, then announce `gathered_key`; returns the seconds spent."""
        began = time.perf_counter()
        rendezvous.wait([staged_key(p, version) for p in self.peers], deadline - time.monotonic(),
                        f"trainer rank {self.rank}: gather-side bf16 of version {version} from trainer ranks {list(self.peers)}")
        self.wait_seconds = time.perf_counter() - began
        for p in self.peers:
            self._connect(agent, rendezvous, p, rendezvous.get_text(staged_key(p, version), INCARNATION))
        self._check_sequence(agent, version, deadline, "before reading")
        agent.read_now([(h, f"trainer rank {p}") for p, peer in self._connected.items() for h in peer.reads], deadline,
                       f"trainer rank {self.rank}: gathering version {version}")
        self._check_sequence(agent, version, deadline, "after reading")
        rendezvous.put(gathered_key(self.rank, version), b"")
        self.seconds = time.perf_counter() - began
        return self.seconds

    def _connect(self, agent: NixlAgent, rendezvous: Rendezvous, rank: int, incarnation: str) -> None:
        """Prepare the READs from one peer unless they exist for this incarnation of it."""
        peer = self._connected.get(rank)
        if peer is not None and peer.incarnation == incarnation:
            return
        if peer is not None:
            self._drop(agent, rank)
        info = rendezvous.get_json(f"trainer/{rank}/info")
        bases = np.array(checked_regions(self.plan, self.tables, rank, info, incarnation), dtype=np.int64)
        mine = np.flatnonzero(self._copies.src_rank == rank)
        c = self._copies.take(mine)
        remote = bases[region_index(exposed_regions(self.plan, self.tables, rank), c)] + c.src_off * 2
        local = self.buffer.data_ptr() + self.offset[mine] * 2
        first, nbytes = contiguous_starts(c.length * 2, (remote, local))
        remote, local = remote[first], local[first]
        name = trainer_agent(rendezvous.job, rank)
        agent.add_peer(rendezvous.get_bytes(f"trainer/{rank}/metadata/{incarnation}"), name)
        local_list = agent.prepare(None, np.stack([local, nbytes], axis=1))
        remote_list = agent.prepare(name, np.stack([remote, nbytes], axis=1))
        seq_local = agent.prepare(None, np.array([[self._seq.data_ptr() + 8 * rank, 8]]))
        seq_remote = agent.prepare(name, np.array([[checked_word(rank, info, "seq")[0], 8]]))
        reads = agent.make_reads(local_list, remote_list, np.arange(len(nbytes)))
        self._connected[rank] = _Peer(incarnation, name, reads, agent.make_read(seq_local, seq_remote, np.zeros(1)),
                                      [local_list, remote_list, seq_local, seq_remote])

    def _check_sequence(self, agent: NixlAgent, version: int, deadline: float, when: str) -> None:
        agent.read_now([(peer.seq_read, f"trainer rank {p}") for p, peer in self._connected.items()], deadline,
                       f"trainer rank {self.rank}: reading peer sequence words {when}")
        for p in self._connected:
            seq = int(self._seq[p])
            if seq != 2 * version:
                raise SyncError(f"trainer rank {self.rank} gathering {when}: trainer rank {p} no longer holds version "
                                f"{version} stable (sequence word {seq}); did it release before this rank finished?")

    def _drop(self, agent: NixlAgent, rank: int) -> None:
        peer = self._connected.pop(rank)
        for handle in [*peer.reads, peer.seq_read]:
            agent.release(handle)
        for prepared in peer.lists:
            agent.release_list(prepared)
        agent.remove_peer(peer.agent)
