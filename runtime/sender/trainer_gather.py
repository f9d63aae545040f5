"""A trainer's gather-side READs at publish: the bf16 its peers hold of the blocks it quantizes, read once per version."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..plan.format import Plan
from ..tables.quant import QuantTables, exposed_regions, region_index
from ..tables.ranks import contiguous_starts
from ..transport import protocol
from ..transport.reader import Transport
from ..transport.peer import Connections, Peer, check_sequence
from ..transport.peer_check import checked_regions, region_fields
from ..transport.rendezvous import Rendezvous


@dataclass(frozen=True)
class _Source:
    """Prepared READs of this rank's gather-side copies from one incarnation of one peer trainer rank."""

    peer: Peer
    reads: list
    seq_read: object


class TrainerGather:
    """Trainer `rank`'s READs of its gather-side stage copies from peer trainer ranks into one bf16 `buffer`.

    Copy i of `tables.gathered(rank)` lands at element `offset[i]`. At every publish the peers'
    bytes are read after they announce `protocol.staged_key` and between two reads of their sequence word,
    which must say the version is stable both times (the same seqlock the receivers use), so a
    peer that moved on cannot leave mixed bytes in a block this rank serves as fp8.

    The buffer lives on `device`, where this rank quantizes (on a GPU the peers' bytes land GPU to GPU); the
    sequence words stay in host memory, which the CPU reads.
    """

    def __init__(self, plan: Plan, rank: int, tables: QuantTables, device: torch.device = torch.device("cpu")):
        self.plan, self.rank, self.tables = plan, rank, tables
        self.rows = tables.gathered(rank)
        c = tables.copies.take(self.rows)
        self.offset = np.cumsum(c.length) - c.length
        self.buffer = torch.empty(int(c.length.sum()), dtype=torch.bfloat16, device=device)
        self.peers = tuple(sorted(set(c.src_rank.tolist())))
        self._copies = c
        self._seq = torch.zeros(plan.header.src_ranks, dtype=torch.int64)
        self._sources: Connections[_Source] | None = None  # made at the first fetch, with the agent
        self.seconds = 0.0
        self.wait_seconds = 0.0  # of `seconds`: waiting for the peers to stage the version

    @property
    def registered(self) -> list[torch.Tensor]:
        return [self.buffer, self._seq]

    def fetch(self, agent: Transport, rendezvous: Rendezvous, version: int, deadline: float) -> float:
        """READ this version's bytes from every peer, then announce `protocol.gathered_key`; returns the seconds spent."""
        began = time.perf_counter()
        rendezvous.wait([protocol.staged_key(p, version) for p in self.peers], deadline - time.monotonic(),
                        f"trainer rank {self.rank}: gather-side bf16 of version {version} from trainer ranks {list(self.peers)}")
        self.wait_seconds = time.perf_counter() - began
        if self._sources is None:
            self._sources = Connections(lambda rank, incarnation: self._connect(agent, rendezvous, rank, incarnation))
        for p in self.peers:
            self._sources.to(p, rendezvous.get_text(protocol.staged_key(p, version), protocol.INCARNATION))
        self._check_sequence(agent, version, deadline, "before reading")
        agent.read_now([(h, f"trainer rank {p}") for p, source in self._sources.by_rank.items() for h in source.reads],
                       deadline, f"trainer rank {self.rank}: gathering version {version}")
        self._check_sequence(agent, version, deadline, "after reading")
        rendezvous.put(protocol.gathered_key(self.rank, version), b"")
        self.seconds = time.perf_counter() - began
        return self.seconds

    def _connect(self, agent: Transport, rendezvous: Rendezvous, rank: int, incarnation: str) -> _Source:
        """Prepare the READs from incarnation `incarnation` of peer `rank`, once its info matches the plan."""
        peer = Peer(agent, rendezvous, protocol.trainer(rank), incarnation)
        info = protocol.TrainerInfo.parse(peer.info, rank)
        bases = np.array(checked_regions(self.plan, self.tables, rank, info, incarnation), dtype=np.int64)
        mine = np.flatnonzero(self._copies.src_rank == rank)
        c = self._copies.take(mine)
        remote = bases[region_index(exposed_regions(self.plan, self.tables, rank), c)] + c.src_off * 2
        local = self.buffer.data_ptr() + self.offset[mine] * 2
        first, nbytes = contiguous_starts(c.length * 2, (remote, local))
        remote, local = remote[first], local[first]
        peer.load(info.memory, info.host)
        local_list = peer.prepare(np.stack([local, nbytes], axis=1), local=True)
        remote_list = peer.prepare(np.stack([remote, nbytes], axis=1), fields=region_fields(info, region_index(exposed_regions(self.plan, self.tables, rank), c)[first].tolist()))
        seq_local = peer.prepare(np.array([[self._seq.data_ptr() + 8 * rank, 8]]), local=True)
        return _Source(peer, peer.reads(local_list, remote_list, np.arange(len(nbytes))),
                       peer.word(seq_local, info.seq, 8, "seq"))

    def _check_sequence(self, agent: Transport, version: int, deadline: float, when: str) -> None:
        check_sequence(agent, {p: source.seq_read for p, source in self._sources.by_rank.items()}, self._seq, version,
                       deadline, f"trainer rank {self.rank}: reading peer sequence words {when}",
                       lambda p, seq: f"trainer rank {self.rank} gathering {when}: trainer rank {p} no longer holds "
                                      f"version {version} stable (sequence word {seq}); did it release before this rank finished?")
