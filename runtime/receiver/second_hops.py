"""Node-local fan-out on an inference rank: READ whole entries from this node's pullers once their first hop landed, and
say when ours landed.

Each rank keeps a landed word (version, state) in registered memory: state WRITING from the start of a sync, LANDED once
its first hop (trainer READs, fp8 quantization, post-ops) is complete, FAILED if that sync failed before landing. A peer
READs the entries only after reading LANDED for its version, and reads the word again afterwards: a puller that moved
on meanwhile fails the peer's sync (a seqlock, as with the trainers' sequence words), so a second hop never keeps bytes
of a version the puller did not hold throughout the READ. A peer done with a puller (read or failed) notifies it
`hop:v`; a puller's sync returns only once every live peer said so, or the timeout passed (a peer that never answers is
given up on until it rejoins or answers, as the trainers do with readers). Waiting keeps the puller's agent progressing
while its peers read, which READs need on transports that are not one-sided (on this host, UCX between processes), and
means no puller writes its next version while a peer still reads the last.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import PlanMismatchError, SyncError
from ..plan.format import Plan
from ..tables.fanout import second_hops, served_entries, served_hops
from ..transport import protocol
from ..transport.memory import check_area
from ..transport.nixl_agent import Backoff
from ..transport.reader import Transport
from ..transport.peer import Connections, Peer
from ..transport.protocol import Kind
from ..transport.rendezvous import Rendezvous

log = logging.getLogger("weightplan.runtime")
WRITING, LANDED, FAILED = 0, 1, 2
_HOP = frozenset({Kind.HOP})


@dataclass(frozen=True)
class _Puller:
    """Prepared READs from one incarnation of a puller of this rank's node."""

    peer: Peer
    word_read: object
    reads: list


class SecondHops:
    """The second hops of inference `rank` of a fan-out plan (`plan.fanout`), into its destination views `dst`."""

    def __init__(self, plan: Plan, rank: int, dst: dict[int, torch.Tensor], rendezvous: Rendezvous):
        self.plan, self.rank, self.rendezvous, self._dst = plan, rank, rendezvous, dst
        self.inbound = second_hops(plan, rank)  # {puller: entries this rank reads from it}
        self.served = served_entries(plan, rank)  # entries peers read from this rank
        self.entries = tuple(sorted(d for dests in self.inbound.values() for d in dests))
        self.bytes = sum(_nbytes(dst[d]) for d in self.entries)
        self._word = torch.tensor([-1, WRITING], dtype=torch.int64)
        self._words = torch.zeros((max(len(self.inbound), 1), 2), dtype=torch.int64)
        self._slot = {p: i for i, p in enumerate(self.inbound)}
        self._pullers: Connections[_Puller] = Connections(self._connect)
        self._local: dict[int, tuple] = {}
        self.agent: Transport | None = None
        self.seconds = 0.0
        self._peers = {protocol.inference(k).agent(rendezvous.job): k for k in served_hops(plan, rank)}
        self._landed: int | None = None  # the version peers may still be reading from this rank
        self._done: set[int] = set()  # peers that said they are done with it
        self._readers: dict[int, str] = {}  # the peers (and their incarnations) expected to read it
        self._given_up: dict[int, str | None] = {}  # peer -> the incarnation that did not answer in time

    @property
    def registered(self) -> list[torch.Tensor]:
        return [self._word, self._words]

    def info(self) -> dict:
        """What peers need to read from this rank: its landed word and the entries it serves (address, bytes)."""
        return {"landed": [self._word.data_ptr(), 16],
                "entries": [[d, self._dst[d].data_ptr(), _nbytes(self._dst[d])] for d in self.served],
                "memory": self.agent.memory.record()}

    def start(self, agent: Transport) -> None:
        """Prepare the local side of every second hop (destination entries and a word slot per puller)."""
        self.agent = agent
        for puller, dests in self.inbound.items():
            rows = np.array([[self._dst[d].data_ptr(), _nbytes(self._dst[d])] for d in dests], dtype=np.int64)
            word = self._words[self._slot[puller]]
            self._local[puller] = (agent.prepare(None, rows), agent.prepare(None, np.array([[word.data_ptr(), 16]])))

    def close(self, deadline: float) -> None:
        """Wait (until `deadline`) for peers still reading the last landed version, then drop every puller."""
        self.settle(deadline)
        self.drop()
        for lists in self._local.values():
            for prepared in lists:
                self.agent.release_list(prepared)
        self._local = {}

    def writing(self, version: int, deadline: float) -> None:
        """Before this rank writes `version`: wait until its peers are done reading the last version, then say so."""
        self.settle(deadline)
        self._word.copy_(torch.tensor([version, WRITING]))

    def landed(self, version: int) -> None:
        self._word.copy_(torch.tensor([version, LANDED]))
        if self._peers:
            self._landed, self._done, self._readers = version, set(), self._awaited()

    def settle(self, deadline: float) -> None:
        """Wait for `hop:v` from every live peer reading the last landed version v, at most until `deadline`."""
        if self._landed is None:
            return
        # peers that joined when it landed and are still that incarnation (a restarted peer never reads the old version)
        current = self._awaited()
        waiting = {peer for peer, incarnation in self._readers.items() if current.get(peer) == incarnation}
        backoff = Backoff()
        while waiting - self._done:
            self._collect()
            if not waiting - self._done:
                break
            if time.monotonic() > deadline:
                late = sorted(waiting - self._done)
                log.warning("inference rank %d: peers %s had not finished reading version %d from it within the timeout; "
                            "not waiting for them again until they answer or rejoin", self.rank, late, self._landed)
                for peer in late:
                    self._given_up[peer] = self._incarnation(peer)
                break
            backoff.sleep()
        self._landed = None

    def _awaited(self) -> dict[int, str]:
        """{served peer: its incarnation} of the peers that joined and were not given up on in that incarnation."""
        out = {}
        for peer in self._peers.values():
            incarnation = self._incarnation(peer)
            if incarnation is not None and self._given_up.get(peer) != incarnation:
                out[peer] = incarnation
        return out

    def _incarnation(self, peer: int) -> str | None:
        try:
            return protocol.joined_incarnation(self.rendezvous, peer)
        except SyncError:  # a malformed record: not a peer to wait for
            return None

    def _collect(self) -> None:
        for peer, message in protocol.received(self.agent, self._peers, _HOP, f"inference rank {self.rank}"):
            self._given_up.pop(peer, None)
            if message.version == self._landed:
                self._done.add(peer)

    def failed(self, version: int) -> None:
        """Tell peers this rank's first hop of `version` will not land (unless it already did: they may read it).

        This rank will not wait for them: a peer still reading when the next version overwrites it fails that read."""
        if self._word.tolist() != [version, LANDED]:
            self._word.copy_(torch.tensor([version, FAILED]))
        self._landed = None

    def receive(self, version: int, deadline: float) -> float:
        """READ every second-hop entry of `version` from the pullers of this node as each one lands; returns seconds."""
        began = time.monotonic()
        pending = sorted(self.inbound)
        for puller in pending:
            self.rendezvous.wait([protocol.joined_key(puller)], deadline - time.monotonic(), f"inference rank {puller} (a puller of this node) to join")
            self._pullers.to(puller, protocol.joined_incarnation(self.rendezvous, puller))
        backoff = Backoff()
        while pending:
            moved = False
            for puller in list(pending):
                if not self._is_landed(puller, version, deadline):
                    continue
                self.agent.read_now([(h, f"inference rank {puller}") for h in self._pullers.by_rank[puller].reads], deadline,
                                    f"version {version} second hop from inference rank {puller}")
                if not self._is_landed(puller, version, deadline):
                    raise SyncError(f"inference rank {puller} started writing another version while this rank read its "
                                    f"first hop of version {version} (a second hop of the plan's fan-out)")
                self.agent.notify(self._pullers.by_rank[puller].peer.name, protocol.hop(version))
                pending.remove(puller)
                moved = True
            if not moved:
                if time.monotonic() > deadline:
                    ranks = ", ".join(f"inference rank {p}" for p in pending)
                    raise SyncError(f"version {version}: timed out waiting for {ranks} of this node to land their first "
                                    f"hop ({self._what(pending)})")
                backoff.sleep()
        self.seconds = time.monotonic() - began
        return self.seconds

    def _what(self, pullers: list[int]) -> str:
        n = sum(len(self.inbound[p]) for p in pullers)
        return f"the pullers of {n} entries this rank reads from them"

    def _is_landed(self, puller: int, version: int, deadline: float) -> bool:
        """True once `puller`'s first hop of `version` landed, False before; SyncError if it failed or moved on."""
        what = f"inference rank {puller}"
        self.agent.read_now([(self._pullers.by_rank[puller].word_read, what)], deadline, f"reading the landed word of {what}")
        held, state = self._words[self._slot[puller]].tolist()
        if held == version and state == LANDED:
            return True
        if held == version and state == FAILED:
            raise SyncError(f"{what} failed its first hop of version {version}, so {self._what([puller])} are incomplete")
        if held > version:
            raise SyncError(f"{what} moved on to version {held} before this rank read version {version} from it")
        return False

    def _connect(self, puller: int, incarnation: str) -> _Puller:
        """Prepare READs from incarnation `incarnation` of `puller`, once its info lists the entries the plan says it serves."""
        peer = Peer(self.agent, self.rendezvous, protocol.inference(puller), incarnation)
        landed_at, size = protocol.words(f"inference rank {puller}", peer.info, "landed", 2)
        entries = peer.info.get("entries")
        if size != 16 or not isinstance(entries, list) or not all(
                isinstance(e, list) and len(e) == 3 and all(type(x) is int and x >= 0 for x in e) for e in entries):
            raise SyncError(f"inference rank {puller}: its info does not describe a landed word and [entry, address, bytes] rows")
        check_area(landed_at, size, "landed", f"inference rank {puller}")
        served = {d: check_area(address, n, f"entries[{d}]", f"inference rank {puller}") for d, address, n in entries}
        mine = self.inbound[puller]
        wrong = [d for d in mine if served.get(d, (0, -1))[1] != _nbytes(self._dst[d])]
        if wrong:
            raise PlanMismatchError(f"inference rank {puller} does not serve {self.plan.dests[wrong[0]].name!r} as this "
                                    "rank's plan says: both ranks must load the same plan file")
        peer.load()
        remote = peer.prepare(np.array([list(served[d]) for d in mine], dtype=np.int64),
                              fields={f"entries[{d}]": served[d] for d in mine})
        local, word_local = self._local[puller]
        return _Puller(peer, peer.word(word_local, landed_at, 16, "landed"), peer.reads(local, remote, np.arange(len(mine))))

    def drop(self, version: int | None = None) -> None:
        """Forget every puller's incarnation (after a failed sync of `version`, telling them this rank is done with it)."""
        if version is not None:
            for puller in self._pullers.by_rank.values():
                self.agent.notify(puller.peer.name, protocol.hop(version))
        self._pullers.drop_all()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
