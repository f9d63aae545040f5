"""An inference rank's NIXL agent and its connections to trainer incarnations: made, renewed after failures, recovered."""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import PlanMismatchError, SyncError
from ..plan.format import Plan
from ..tables.quant import stage_packing
from ..tables.ranks import RemoteRegion, region_addresses
from ..transport import protocol
from ..transport.local_peer import HOST_READ, UNSIGNED, NotLocal, Registered, open_local
from ..transport.nixl_agent import NixlAgent, PeerLost, Unreachable
from ..transport.peer import Connections, Peer, check_sequence
from ..transport.peer_check import checked_regions, region_fields
from ..transport.reader import Routed, Transport
from ..transport.rendezvous import Rendezvous

log = logging.getLogger("weightplan.runtime")
# A trainer UCX could not connect to is tried again, after CONNECT_RETRY_S doubling up to 1 s, for at most
# CONNECT_PATIENCE_S (within the sync's timeout): a refusal that clears heals within the sync, a trainer that is gone
# costs the sync this much, not its whole timeout.
CONNECT_RETRY_S = 0.05
CONNECT_PATIENCE_S = 10.0


@dataclass(frozen=True)
class Trainer:
    """Prepared transfers to one incarnation of one trainer rank; rebuilt when that trainer restarts."""

    peer: Peer
    seq_read: object
    ring_word_read: object
    group_reads: tuple[dict[int, list], ...]  # per destination set (the destination, then each alternate)
    ring_reads: tuple[dict[int, list], ...]  # READs of each ring chunk, when it serves through a ring, per set
    delta: object = None  # its delta areas (runtime/receiver/delta.py DeltaSource), None when it keeps no deltas
    full_only_reads: dict[int, list] = field(default_factory=dict)  # group READs a delta does not replace (staging slots)
    deltable_bytes: int = 0  # bytes of the READs from it a delta replaces
    paths: dict[str, int] = field(default_factory=dict)  # bytes of a full sync from it, by path (SyncReport.paths)
    deltable_paths: dict[str, int] = field(default_factory=dict)  # of those, the bytes a delta replaces
    delta_path: str = "nixl"  # the path its delta bytes (host memory) take

    @property
    def rank(self) -> int:
        return self.peer.endpoint.rank


class TrainerConnections:
    """Inference `rank`'s NIXL agent (`open` makes it over the registered memory, `close` releases it, `renew` replaces
    it after a failure), its prepared transfers to each trainer incarnation it reads (`trainers`, made by `connect`),
    and the recovery around them: connecting again to a trainer UCX refused, once more after a connection found broken
    between syncs, telling the trainers a sync failed (`fail`).

    `tables` are the rank's read tables (runtime/tables/receiver.py), `local_rows` each destination set's local
    addresses, `quant_tables` the plan's fp8 tables or None, `delta` and `hops` the rank's ReceiverDelta (or None) and
    SecondHops, `sources` the trainer ranks it reads. The trainers' sequence and ring words are read into `seq` and
    `ring_word` (registered with the rest)."""

    def __init__(self, plan: Plan, rank: int, rendezvous: Rendezvous, *, sources: list[int], tables, local_rows: list[dict],
                 quant_tables, delta, hops, verify: bool, ring_bytes: int, progress: str, device_ipc: str):
        self.plan, self.rank, self.rendezvous, self._sources = plan, rank, rendezvous, sources
        self._tables, self._local_rows, self._qt, self._delta, self._hops = tables, local_rows, quant_tables, delta, hops
        self._verify, self._ring_bytes, self._device_ipc = verify, ring_bytes, device_ipc
        self._thread = progress == "thread"  # a Receiver progresses its agent itself while it syncs
        self.seq = torch.zeros(plan.header.src_ranks, dtype=torch.int64)
        self.ring_word = torch.zeros((plan.header.src_ranks, 2), dtype=torch.int64)
        self.trainers: Connections[Trainer] = Connections(self._connect)
        self.agent: Transport | None = None  # made, with the registered memory, by open()
        self.reader: Routed | None = None  # READs through the agent or a trainer's LocalReader
        self._registered: list[torch.Tensor] = []
        self._not_local: set[tuple[int, str]] = set()  # (trainer rank, why) already logged
        self._unreachable: set[str] = set()  # trainer incarnations already logged as unreachable
        self._deadline = 0.0  # of the connecting under way

    @property
    def words(self) -> list[torch.Tensor]:
        return [self.seq, self.ring_word]

    def open(self, registered: list[torch.Tensor]) -> None:
        """A new NIXL agent (a new UCX worker) with `registered` registered and this rank's local descriptor lists."""
        self._registered = registered
        self.agent = NixlAgent(protocol.inference(self.rank).agent(self.rendezvous.job), self._thread)
        self.agent.register(self._registered)
        self.reader = Routed(self.agent)
        self._hops.start(self.agent)
        if self._delta:
            self._delta.start(self.agent)
        self._local = [{src: self.agent.prepare(None, np.stack([rows[src], t.nbytes], axis=1))
                        for src, t in self._tables.descriptors.items()} for rows in self._local_rows]
        self._seq_local = {src: self.agent.prepare(None, np.array([[self.seq.data_ptr() + 8 * src, 8]]))
                           for src in self._sources}
        self._ring_local = {src: self.agent.prepare(None, np.array([[self.ring_word[src].data_ptr(), 16]]))
                            for src in self._sources}

    def close(self, deadline: float) -> None:
        """Drop every peer, release the local lists and close the agent (its UCX worker and every connection it held)."""
        self.trainers.drop_all()
        self._hops.close(deadline)
        for prepared in [*(p for local in self._local for p in local.values()), *self._seq_local.values(),
                         *self._ring_local.values()]:
            self.agent.release_list(prepared)
        if self._delta:
            self._delta.release(self.agent)
        self.agent.close()
        self._local, self._seq_local, self._ring_local = [], {}, {}

    def renew(self) -> None:
        """Before a sync, when a READ timed out or failed, or a trainer's agent could not be loaded: a new agent (a new UCX
        worker) in place of the old one, closed with every connection it held. READs of a failed sync still queued on a
        connection a link cut broke would otherwise be answered once the link returns and land in the destination
        during or after a later sync (seen in the soak: one tensor of a completed version held bytes of an older READ);
        and a worker made while its node's link was down never reaches another node ("Destination is unreachable").
        A new agent is also made when this host's network links changed since the last was made (UCX lists them once).
        A puller keeps its agent: its node's peers hold its published metadata."""
        if self._hops.served:
            return
        if self.agent.links_changed:
            log.info("inference rank %d: a new NIXL agent (this host's network links changed since the last one was "
                     "made)", self.rank)
        elif self.agent.stuck:
            log.info("inference rank %d: a new NIXL agent (the last one's connections may be broken)", self.rank)
        else:
            return
        self.close(time.monotonic())
        gc.collect()  # the old agent's handles hold its worker: destroy it (its sockets) now
        self.open(self._registered)

    def may_be_given_up(self, version: int, acked: int | None) -> bool:
        """Whether the trainers may have stopped waiting for this rank before `version`: its last sync failed and its
        agent is to be renewed, or it did not ack the version before (`acked`: it failed or skipped it, as an engine busy
        generating may). Such a rank says it is back (protocol.returning_key) before it connects, so that the trainers'
        release holds `version` open for it while it does."""
        stuck = self.agent.stuck and not self._hops.served  # a rank serving second hops keeps its agent (renew)
        return stuck or (acked is not None and acked != version - 1)

    def connect(self, version: int, incarnations: dict[int, str], deadline: float) -> float:
        """Renew the agent if it must be, connect to each trainer incarnation, tell it this rank reads `version`, and check
        that every trainer holds it stable; returns when the connecting was done (time.monotonic()).

        A connection NIXL found broken while no sync ran (a link cut between syncs) is made again from the published
        metadata, once, rather than fail this version too."""
        self.renew()  # here, once the store answered: a worker made while this node's link is down reaches nothing
        self.connect_all(version, incarnations, deadline)
        connected = time.monotonic()
        try:
            self.check_sequence(version, deadline, "before reading")
        except PeerLost as exc:
            log.info("inference rank %d: %s; connecting to trainer ranks %s again", self.rank, exc, sorted(incarnations))
            self.trainers.drop_all()
            self.renew()
            self.connect_all(version, incarnations, deadline)
            connected = time.monotonic()
            self.check_sequence(version, deadline, "before reading")
        return connected

    def connect_all(self, version: int, incarnations: dict[int, str], deadline: float) -> None:
        """Connect to each trainer rank's incarnation (kept from an earlier sync when it is the same) and tell it this rank
        starts reading `version`.

        A trainer UCX cannot connect to is tried again, the first time with a new agent of this rank (a worker that
        cannot reach a live trainer, e.g. one made while this node's link was down, is replaced), then with that one
        (with another whenever this host's links changed since it was made),
        backing off up to 1 s, for CONNECT_PATIENCE_S or until `deadline`: the sync then fails naming that trainer,
        logged once per trainer incarnation, and the next sync tries again. A rank serving second hops keeps its agent
        (its node's peers hold its metadata): it tries once."""
        self._deadline = deadline
        pause = CONNECT_RETRY_S
        deadline = min(deadline, time.monotonic() + CONNECT_PATIENCE_S)
        renewed = False
        while True:
            try:
                for r, incarnation in incarnations.items():
                    self.trainers.to(r, incarnation)
                break
            except Unreachable as exc:
                if self._hops.served or time.monotonic() + pause > deadline:
                    raise
                first = str(exc).split(":", 1)[0]  # "trainer rank r at HOST (incarnation ...)"
                if first not in self._unreachable:
                    self._unreachable.add(first)
                    log.warning("inference rank %d: %s; trying again for up to %.0f s", self.rank, exc,
                                CONNECT_PATIENCE_S)
                time.sleep(pause)
                pause = min(2 * pause, 1.0)
                if not renewed or self.agent.links_changed:  # a link that came back meanwhile: a worker that sees it
                    self.renew()
                    renewed = True
        self.notify_all(protocol.begin(version))

    def check_sequence(self, version: int, deadline: float, when: str) -> None:
        """SyncError unless every trainer's sequence word says it holds `version` stable."""
        def unstable(rank: int, seq: int) -> str:
            state = "is staging or retired it" if seq == 2 * version + 1 else f"holds version {seq // 2}"
            return f"trainer rank {rank} {when}: expected stable version {version}, the trainer {state}"

        check_sequence(self.reader, {rank: t.seq_read for rank, t in self.trainers.by_rank.items()}, self.seq, version,
                       deadline, f"reading trainer sequence words {when}", unstable)

    def notify_all(self, message: str) -> None:
        for t in self.trainers.by_rank.values():
            self.agent.notify(t.peer.name, message)

    def fail(self, version: int) -> None:
        """Tell every trainer still reachable that this rank failed `version`, and drop the connections."""
        self.notify_all(protocol.fail(version))
        if self.agent.stuck:
            self.agent.flush(0.1)  # the fail notifications go out to the trainers still reachable, before renew()
        self.trainers.drop_all()

    def incarnations(self) -> dict[int, str]:
        """{trainer rank: the incarnation connected to}."""
        return {r: t.peer.incarnation for r, t in self.trainers.by_rank.items()}

    def paths(self, took: set[int], delta_read: dict[int, int]) -> dict[str, int]:
        """A sync's `bytes` by path: each trainer's full bytes, or for one whose delta applied (`took`), the bytes a delta
        does not replace and its delta (`delta_read`)."""
        out: dict[str, int] = {}
        for rank, t in self.trainers.by_rank.items():
            parts = [t.paths]
            if rank in took:
                parts += [{k: -v for k, v in t.deltable_paths.items()}, {t.delta_path: delta_read.get(rank, 0)}]
            for part in parts:
                for path, n in part.items():
                    out[path] = out.get(path, 0) + n
        return {path: n for path, n in sorted(out.items()) if n}

    def _connect(self, rank: int, incarnation: str) -> Trainer:
        """Prepare transfers to incarnation `incarnation` of trainer `rank`, once its info matches this rank's tables."""
        peer = Peer(self.agent, self.rendezvous, protocol.trainer(rank), incarnation)
        info = protocol.TrainerInfo.parse(peer.info, rank)
        regions = checked_regions(self.plan, self._qt, rank, info, incarnation)
        mismatch = info.options.mismatch(self._ring_bytes, self._verify, self.rank, self.plan.header.dst_ranks)
        if mismatch:
            raise PlanMismatchError(f"trainer rank {rank}: {mismatch}")
        packed_addr, packed_bytes = info.packed
        if packed_bytes != self._tables.packed_bytes[rank]:
            raise PlanMismatchError(f"trainer rank {rank} packs {packed_bytes} bytes of small runs, this rank expects "
                                    f"{self._tables.packed_bytes[rank]}: run the same weightplan version on both sides")
        ring_addr, slot_bytes = info.ring
        if slot_bytes != self._tables.slot_bytes[rank]:
            raise PlanMismatchError(f"trainer rank {rank} serves its small runs from a region of {slot_bytes} bytes, this "
                                    f"rank expects {self._tables.slot_bytes[rank]}: give its Sender and this Receiver the same ring_bytes")
        quant = self._quant_regions(rank, info)
        local = info.local if self._device_ipc == "auto" else None
        peer.load(info.memory, info.host)
        if local is not None:
            peer.reader = self._open_local(rank, peer, info)
        table = self._tables.descriptors[rank]
        bases = region_addresses(table.region, regions, {RemoteRegion.PACKED: packed_addr, **quant})
        # The info's areas these READs use, to name the one the trainer did not register if NIXL refuses them.
        areas = {RemoteRegion.PACKED: ("packed", (packed_addr, packed_bytes))} | {
            region: (f"quant.{key}", info.quant[key]) for region, key in
            ((RemoteRegion.STAGE_PACKED, "stage_packed"), (RemoteRegion.SCALES, "scales"), (RemoteRegion.FP8, "fp8")) if quant}
        fields = region_fields(info, table.region[table.region >= 0].tolist()) | dict(
            areas[region] for region in areas if (table.region == region).any())
        remote_rows = np.stack([bases + table.remote_off, table.nbytes], axis=1)
        remote = peer.prepare(remote_rows, fields=fields)
        direct = table.chunk < 0
        delta = self._delta.connect(rank, peer, info) if self._delta else None
        deltable = self._delta.trainers[rank].deltable if self._delta else np.zeros(len(table), dtype=bool)
        return Trainer(
            peer, peer.word(self._seq_local[rank], info.seq, 8, "seq"),
            peer.word(self._ring_local[rank], ring_addr, 16, "ring"),
            tuple({g: peer.reads(local[rank], remote, np.flatnonzero((table.group == g) & direct))
                   for g in np.unique(table.group[direct]).tolist()} for local in self._local),
            tuple({c: peer.reads(local[rank], remote, np.flatnonzero(table.chunk == c))
                   for c in np.unique(table.chunk[~direct]).tolist()} for local in self._local),
            delta,
            {} if delta is None else {g: peer.reads(self._local[0][rank], remote, rows) for g in np.unique(table.group[direct]).tolist()
                                      if len(rows := np.flatnonzero((table.group == g) & direct & ~deltable))},
            int(table.nbytes[deltable].sum()), peer.reader.path_bytes(peer.memory, remote_rows),
            peer.reader.path_bytes(peer.memory, remote_rows[deltable]),
            HOST_READ if peer.reader is not self.agent else self.agent.path)  # deltas are of host tensors only

    def _open_local(self, rank: int, peer: Peer, info: protocol.TrainerInfo):
        """A LocalReader of trainer `rank` when the job has a secret (which authenticates the record saying what to read)
        and the trainer runs on this host and opens here, else its NIXL agent (why: logged once per trainer rank and
        reason, and once in all for a job without a secret)."""
        try:
            if not self.rendezvous.authenticated:
                raise NotLocal(UNSIGNED)
            reader = open_local(info.local, peer.memory, peer.incarnation, self._registered, str(peer.endpoint),
                                Registered(self.agent, peer.name))
        except NotLocal as exc:
            seen = (None if str(exc) == UNSIGNED else rank, str(exc))
            if seen not in self._not_local:
                self._not_local.add(seen)
                log.warning("inference rank %d reads %s over NIXL, not directly: %s", self.rank,
                            "its trainers" if seen[0] is None else f"trainer rank {rank}", exc)
            return self.agent
        # NIXL still carries the notifications: one READ over it wires its connection up now (a connection UCX makes
        # on a first notification needs this rank to progress its agent afterwards, which it would not do).
        seq = peer.word(self._seq_local[rank], info.seq, 8, "seq")
        self.agent.read_now([(seq, f"trainer rank {rank}")], self._deadline, "connecting over NIXL")
        return reader

    def _quant_regions(self, rank: int, info: protocol.TrainerInfo) -> dict[RemoteRegion, int]:
        """Addresses of trainer `rank`'s packed stage copies, scales and fp8 values, after checking their sizes."""
        if self._qt is None:
            return {}
        fp8, scales = self._qt.region_bytes(rank)
        expected = {"stage_packed": stage_packing(self.plan, self._qt, rank).nbytes, "scales": 4 * scales, "fp8": fp8}
        quant = info.quant
        if quant is None:
            raise SyncError(f"trainer rank {rank}: its info has no fp8 regions ('quant'), which this plan needs")
        regions = {k: quant[k] for k in expected}
        if {k: size for k, (_, size) in regions.items()} != expected:
            raise PlanMismatchError(f"trainer rank {rank} exposes fp8 regions {quant}, this rank expects sizes {expected}: "
                                    "run the same weightplan version on both sides")
        return {RemoteRegion.STAGE_PACKED: regions["stage_packed"][0], RemoteRegion.SCALES: regions["scales"][0],
                RemoteRegion.FP8: regions["fp8"][0]}
