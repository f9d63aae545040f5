"""The trainer end of a sync: exposes one rank's shard bytes in wire dtype and publishes versions."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from ..casts import cast_along, cast_into
from ..checks import check_host_only, check_tensors, check_version, flat_view, named_tensors
from ..device import DeviceSync
from ..errors import SyncError, WeightplanError
from ..fp8.placement import fp8_placement
from ..options import SyncOptions
from ..plan.format import Plan
from ..plan.schema import RECEIVER
from ..tables.quant import check_supported, exposed_regions, quant_readers, quant_tables
from ..tables.ranks import check_pool, check_src_rank, packing_of, pool_members, readers, served_runs
from ..tables.ring import DEFAULT_RING_BYTES, ring_chunks
from ..transport import protocol
from ..transport.lifecycle import AgentOwner
from ..transport.local_record import local_record
from ..transport.nixl_agent import NixlAgent
from ..transport.reader import Transport
from ..transport.protocol import Kind, Message
from ..transport.region_digests import byte_view, run_digests
from ..transport.rendezvous import Rendezvous, is_loopback
from ..delta.pages import Space
from .delta import DeltaStats, SenderDelta
from .pack import CastSource, PackRuns
from .quant import SenderQuant
from .release import ReleaseReport, ReleaseWait
from .trainer_gather import TrainerGather

log = logging.getLogger("weightplan.runtime")
_READER_MESSAGES = frozenset({Kind.BEGIN, Kind.ACK, Kind.FAIL, Kind.RING})


@dataclass(frozen=True)
class SenderStats:
    """Memory a trainer rank holds for serving: runtime tables (proportional to its stored runs, not their rows),
    its packed region of small runs, and everything it writes at publish (staging_bytes, packed region included)."""

    table_bytes: int
    packed_bytes: int
    staging_bytes: int
    stored_runs: int  # the plan's stored runs this rank serves (each standing for `count` rows)


class Sender(AgentOwner):
    """Serve trainer `rank`'s bytes of `plan` to every inference rank that reads them.

    Sources whose wire dtype is their own are exposed in place (zero copy): after `publish(v)` the
    trainer must call `release(v)` before changing them. Cast sources (e.g. fp32 masters sent as
    bf16) are staged at `publish`. With fp8 tables, `publish` also quantizes the blocks this rank
    alone holds into registered fp8 and scale regions (runtime/sender/quant.py), and the gather-side
    blocks it quantizes for several ranks after READing their peers' bf16 (runtime/sender/trainer_gather.py):
    every trainer rank of such a plan must call `publish(v)` at about the same time, since each waits
    for the peers it gathers from. A sequence word in registered memory lets receivers and gathering
    peers detect bytes that changed while they read (seqlock: 2v while v is stable, odd otherwise).

    Small runs are packed into one region at publish (runtime/sender/pack.py). When they exceed
    `ring_bytes` (default 512 MiB), the region is a ring the size of the largest chunk of them
    (runtime/tables/ring.py): `publish` packs chunk 0 and `release` packs chunk c + 1 once every live
    reader of chunk c acknowledged it (receivers need the same `ring_bytes`). A ring word in registered
    memory ((version, 2c) while chunk c is stable, 2c - 1 while packing it) lets readers check each chunk.

    Between `publish(v)` and `release(v)` the trainer may compute without calling the runtime: where READs need the
    target to progress (TCP; `progress`, runtime/transport/progress.py), a light background poll answers them.

    With `delta` (a fraction in (0, 1]), `publish(v)` also diffs every page receivers READ into destinations
    against the previous publish and encodes what changed into a registered region of that fraction of their bytes
    (runtime/sender/delta.py); receivers that hold the previous version READ that instead of the full bytes. It costs
    one copy of those pages (the previous version) plus the region.

    With fp8 tables, the fp8 and scale regions, stage copies, arena and gather buffer live on the device of the
    trainer's tensors (all on one device), and publish gathers and quantizes there in torch ops: on a GPU nothing
    leaves it. Host tensors quantize in the numba kernel; `fp8_path="device"` makes them take the GPU's torch-op
    path instead (how the tests prove that path here; runtime/fp8/placement.py).

    `pool_ranks` (default: the plan's inference ranks) lets DP replicas beyond the plan's ranks read this rank, each
    with the tables of the plan rank it copies (runtime/tables/ranks.py `layout_rank`): its `readers` are every rank of
    the pool that reads it, and `release` waits for those that joined with this plan and have not left (protocol.left_key),
    so a pool rank that never joins costs a store lookup per release, and a rank running another plan (another expert
    parallel size, before or after a resize: docs/operations.md) is never waited for.

    `timeout`, `verify` (publish each version's digests for Receivers with verify=True), `progress`, `ring_bytes`,
    `delta`, `fp8_path`, `delta_path` and `pool_ranks` are the options both ends share, one record (`options`:
    runtime/options.py). `release` waits through a ReleaseWait (runtime/sender/release.py).

    The constructor only checks the tensors against the plan and allocates staging; `start()` registers
    the memory with NIXL and publishes this rank's info, `close()` deregisters it and releases the
    agent. `with Sender(...) as sender:` does both.
    """

    def __init__(self, plan: Plan, rank: int, tensors, *, rendezvous: Rendezvous, timeout: float = 60.0,
                 verify: bool = False, progress: str = "auto", ring_bytes: int = DEFAULT_RING_BYTES, delta: float = 0.0,
                 fp8_path: str = "auto", delta_path: str = "auto", pool_ranks: int | None = None):
        check_src_rank(plan, rank)
        # The options both ends share, one name per idea (runtime/options.py); progress: runtime/transport/progress.py.
        self.options = SyncOptions(timeout=timeout, verify=verify, progress=progress, ring_bytes=ring_bytes, delta=delta,
                                   fp8_path=fp8_path, delta_path=delta_path, pool_ranks=check_pool(plan, pool_ranks))
        if plan.staging:
            check_supported(plan)
        plan = plan.pulling  # with fan-out, each replicated entry is read from this rank by one inference rank per node
        self.plan, self.rank, self.rendezvous = plan, rank, rendezvous
        tables = quant_tables(plan) if plan.staging else None
        self.regions = exposed_regions(plan, tables, rank)
        # Sources this rank quantizes from itself are read locally; they are exposed only if others read them.
        c = tables.copies if tables else None
        local = sorted(set(c.src[(c.side != RECEIVER) & (c.src_rank == rank) & (c.quant_rank == rank)].tolist())
                       if tables else set())
        given = named_tensors(tensors)
        expected = {plan.sources[s].name: (plan.local_shape(s, rank), plan.sources[s].dtype)
                    for s in [r.source for r in self.regions] + local}
        check_tensors(given, expected, {e.name for e in plan.sources}, f"trainer rank {rank}")
        flat = {s: flat_view(plan.sources[s].name, given[plan.sources[s].name], *expected[plan.sources[s].name],
                             f"trainer rank {rank}") for s in [r.source for r in self.regions] + local}
        self._sources = [flat[r.source] for r in self.regions]
        check_host_only(flat.values(), {"verify=True": verify}, f"trainer rank {rank}")
        self._served_runs = served_runs(plan, rank)
        self.packing = packing_of(self._served_runs)
        # Cast regions no receiver reads in place are cast straight into the packed region: no staging copy.
        casts = {} if tables is not None else self._packed_only_casts()
        devices = {t.device for t in self._sources}
        # fp8 regions, stage copies, arena and gather buffer live on the device of this rank's tensors and are computed
        # there (runtime/fp8/placement.py); receivers and gathering peers READ them from it.
        fp8 = fp8_placement(flat.values() if tables is not None else (), fp8_path, f"trainer rank {rank}")
        # Memory is allocated and registered only after every check passed. Staging lives with its source and the
        # packed region with the sources when they share one device (host memory otherwise): the cast and packing
        # kernels write them where they run (docs/operations.md, "GPUs").
        self._exposed = [
            None if i in casts else torch.empty(r.numel, dtype=getattr(torch, r.wire_dtype), device=src.device) if r.staged else src
            for i, (r, src) in enumerate(zip(self.regions, self._sources))
        ]
        packed_device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        try:
            self.ring = ring_chunks(self.packing, ring_bytes)
        except ValueError as exc:
            raise WeightplanError(f"trainer rank {rank}: {exc}") from None
        parts = [self.packing] if self.ring is None else [self.ring.part(self.packing, c) for c in range(len(self.ring))]
        self._packed = torch.empty(max(p.nbytes for p in parts), dtype=torch.uint8, device=packed_device)
        self._packs = [PackRuns(self._exposed, self._packed, p, self._served_runs, casts) for p in parts]
        at = np.searchsorted(self._served_runs.run, self.packing.run) if self.ring is not None else []
        pool = self.options.pool_ranks

        def holders(dests: np.ndarray) -> set[int]:
            """Every rank of the pool holding one of these entries."""
            return set(pool_members(plan, {k for d in set(dests.tolist()) for k in plan.dests[d].ranks}, pool))

        self._chunk_readers = [] if self.ring is None else [
            holders(self._served_runs.dest[at[lo:hi]])
            for lo, hi in zip(self.ring.first[:-1].tolist(), self.ring.first[1:].tolist())]
        self._ring_word = torch.zeros(2, dtype=torch.int64)  # (version, 2c: chunk c in the ring, 2c - 1: packing it)
        self._ring_next = len(self._packs)  # the next chunk to pack: all packed
        self._gather = TrainerGather(plan, rank, tables, fp8.device) if tables is not None and len(tables.gathered(rank)) else None
        self.gatherers = tables.gatherers(rank) if tables else ()  # peer trainer ranks reading this rank's bf16
        self._quant = (SenderQuant(plan, rank, tables, self.regions, self._exposed, flat, fp8,
                                   *((self._gather.buffer, self._gather.offset) if self._gather else ()))
                       if tables else None)
        # Delta syncs (runtime/sender/delta.py): `delta` is the fraction of the served pages its region holds; 0: none.
        self._delta = SenderDelta(plan, rank, tables, ring_bytes, delta, self._delta_spaces(), delta_path) if delta else None
        self._seq = torch.ones(1, dtype=torch.int64)  # odd: nothing published yet
        # Publishing waits for every kernel queued on the devices of these tensors (optimizer, casts, packing,
        # quantization) before the sequence word, ring word or version record exposes their bytes (runtime/device.py).
        self.device_sync = DeviceSync.of([*self._sources, *self._exposed, self._packed,
                                          *(self._quant.registered if self._quant else [])])
        self.readers = pool_members(plan, set(readers(plan, rank)) | set(quant_readers(plan, tables, rank) if tables else ()),
                                    pool)
        self.incarnation = uuid.uuid4().hex
        self.agent: Transport | None = None  # created, with this rank's memory registered, by start()
        self._live: set[int] = set()  # inference ranks whose acknowledgement release() waits for
        self._joined: dict[int, str] = {}
        self._given_up: dict[int, str | None] = {}
        self._other_plan: dict[int, str] = {}  # inference rank -> its incarnation that joined with another plan (logged)
        self._inbox: list[tuple[int, Message]] = []  # (inference rank, what it said)
        self._pending: int | None = None
        self.digest_seconds = 0.0
        self.quantize_seconds = 0.0
        self.gather_seconds = 0.0

    def _packed_only_casts(self) -> dict[int, CastSource]:
        """Cast regions whose every served run is packed (none read in place), at wire-aligned packed offsets."""
        served, packing = self._served_runs, self.packing
        packed_at = packing.offsets_of(served.run)
        in_place = set(served.region[packed_at < 0].tolist())
        out = {}
        for i, region in enumerate(self.regions):
            if not region.staged or i in in_place:
                continue
            wire = getattr(torch, region.wire_dtype)
            if np.all(packed_at[served.region == i] % wire.itemsize == 0):
                out[i] = CastSource(self._sources[i], self.plan.cast_chains[region.chain], wire)
        return out

    def _exposed_bytes(self) -> list[torch.Tensor]:
        """Every region's wire bytes as served (cast-into-packed regions cast again here, for digests only)."""
        return [byte_view(x if x is not None else cast_along(src, self.plan.cast_chains[r.chain]))
                for r, src, x in zip(self.regions, self._sources, self._exposed)]

    def start(self) -> "Sender":
        """Register this rank's memory with a new NIXL agent and publish its info for readers; returns self.

        Side effects live here, not in the constructor (which only checks and allocates): call it once
        before `publish`, or use the sender as a context manager, which also closes it.
        """
        if self.agent is not None:
            raise WeightplanError(f"trainer rank {self.rank}: this Sender was started already")
        rank, rendezvous = self.rank, self.rendezvous
        me = protocol.trainer(rank)
        self.agent = NixlAgent(me.agent(rendezvous.job), self.options.progress)
        host = rendezvous.local_host()
        if not self.agent.links and host is not None and not is_loopback(host):
            log.warning("trainer rank %d: no network link of this host was up when its NIXL agent was made (UCX lists "
                        "links once): readers on other hosts cannot reach it until this process starts again", rank)
        # Readers on this host check that this process holds its incarnation here before reading it directly, and
        # read it only as registered memory (NIXL's record of what this process registered bounds what they read).
        self._probe = torch.tensor(list(bytes.fromhex(self.incarnation)), dtype=torch.uint8)
        registered = ([t for t in self._exposed if t is not None] + [self._packed, self._seq, self._ring_word, self._probe]
                      + (self._quant.registered if self._quant else [])
                      + (self._gather.registered if self._gather else [])
                      + (self._delta.registered if self._delta else []))
        self.agent.register(registered)
        plan = self.plan
        pool = self.options.pool_ranks if self.options.pool_ranks > plan.header.dst_ranks else None  # None: no pool
        rendezvous.put(me.metadata_key(self.incarnation), self.agent.metadata())
        rendezvous.put(protocol.trainer_info_key(rank), protocol.TrainerInfo(
            fingerprint=plan.fingerprint, incarnation=self.incarnation, agent=self.agent.name, seq=self._seq.data_ptr(),
            packed=(self._packed.data_ptr(), self.packing.nbytes), ring=(self._ring_word.data_ptr(), self._packed.numel()),
            regions=tuple(protocol.ServedRegion(r.source, r.chain, 0 if t is None else t.data_ptr(), r.nbytes)
                          for r, t in zip(self.regions, self._exposed)),
            memory=self.agent.memory,  # host or which GPU each registered area is on
            options=protocol.SharedOptions(self.options.ring_bytes, self.options.verify, pool),
            quant={k: tuple(v) for k, v in self._quant.info().items()} if self._quant else None,
            delta={k: tuple(v) for k, v in self._delta.info().items()} if self._delta else None,
            local=local_record(registered, self._probe),  # what a reader on this host opens directly
            host=host,
        ).to_json())
        log.info("trainer rank %d serves %d regions (%d staged) to inference ranks %s",
                 rank, len(self.regions), sum(r.staged for r in self.regions), list(self.readers))
        return self

    def close(self) -> None:
        """Retire the pending version, deregister this rank's memory and release its agent; idempotent."""
        if not self.running:
            return
        if self._pending is not None:
            self._seq.fill_(2 * self._pending + 1)  # a reader still reading sees the version retired
            self._pending = None
        self.agent.close()

    @property
    def stats(self) -> SenderStats:
        """What this rank keeps per sync: its runtime tables and the region it packs small runs into."""
        tables = sum(p.table_bytes for p in self._packs) + (self.ring.first.nbytes + self.ring.start.nbytes if self.ring else 0)
        return SenderStats(self._served_runs.footprint() + self.packing.footprint() + tables, self._packed.numel(),
                           self.staging_bytes, len(self._served_runs))

    @property
    def staging_bytes(self) -> int:
        """Bytes this rank writes at every publish: cast regions, packed small runs, and with fp8 tables the
        packed stage copies and the fp8 values and scales."""
        quant = sum(t.numel() * t.element_size() for t in self._quant.registered) if self._quant else 0
        staged = sum(r.nbytes for r, t in zip(self.regions, self._exposed) if r.staged and t is not None)
        return staged + self._packed.numel() + quant

    def publish(self, version: int) -> None:
        """Stage this rank's bytes for `version` and announce it. Releases the previous version first.

        With gather-side blocks this waits for the peers it gathers from to stage `version` too; a
        SyncError then leaves the version unannounced (its receivers time out and keep no mixed bytes).
        """
        check_version(version)
        self._started()
        protocol.check_resumed(self.rendezvous, self.rank, version, self.incarnation, self.rendezvous.job)
        if self._pending is not None:
            self.release(self._pending)
        self._seq.fill_(2 * version + 1)
        self._ring_word.copy_(torch.tensor([version, -1]))
        with torch.no_grad():
            for region, src, out in zip(self.regions, self._sources, self._exposed):
                if region.staged and out is not None:
                    cast_into(out, src, self.plan.cast_chains[region.chain])
            self._packs[0]()
        self.device_sync.wait("publish: the trainer's kernels, casts and packing")
        self._ring_word[1] = 0
        self._ring_next = 1
        # The exposed bf16 is final for this version; receivers still wait for the version key below,
        # and fp8 regions rewritten from here on are read only after it.
        self._seq.fill_(2 * version)
        if self.gatherers:
            self.rendezvous.put(protocol.staged_key(self.rank, version), self.incarnation.encode())
        if self._gather is not None:
            try:
                self.gather_seconds = self._gather.fetch(self.agent, self.rendezvous, version,
                                                         time.monotonic() + self.options.timeout)
            except SyncError:
                self._seq.fill_(2 * version + 1)
                raise
        if self._quant is not None:
            self.quantize_seconds = self._quant.publish(self._poll if self.gatherers else None)
            self.device_sync.wait("publish: quantization")
        if self._delta is not None:
            self._publish_delta(version)
        if self.options.verify:
            began = time.perf_counter()
            served = self._served_runs
            found = run_digests(self._exposed_bytes(), served.region, served.src_byte, served.src_stride, served)
            found = {str(k): v for k, v in found.items()}
            if self._quant is not None:
                found.update(self._quant.digests(self._exposed))
            self.rendezvous.put(protocol.digests_key(self.rank, version), found)
            self.digest_seconds = time.perf_counter() - began
        self._pending = version
        try:
            self.rendezvous.put(protocol.published_key(self.rank), protocol.published_record(version, self.incarnation))
            self.rendezvous.put(protocol.version_key(self.rank, version), self.incarnation.encode())
        except SyncError:  # not announced (the store unreachable): retired at once, so the next publish waits for no one
            self._pending = None
            self._seq.fill_(2 * version + 1)
            raise
        self.agent.background(True)  # readers READ while the trainer computes: someone must answer them (TCP)

    def _publish_delta(self, version: int) -> None:
        """Encode the delta of `version` against the previous publish and announce it (before the version key).

        With a ring every chunk is packed once here to be diffed, then chunk 0 again for the readers that take it full.
        """
        if self.ring is not None:
            self._ring_word[1] = -1
        record = self._delta.publish(version, self._delta_space)
        if self.ring is not None:
            with torch.no_grad():
                self._packs[0]()
            self._ring_word[1] = 0
        self.rendezvous.put(protocol.delta_key(self.rank, version), protocol.delta_record(record))

    def _delta_spaces(self) -> list[torch.Tensor]:
        """Every tensor a delta page space can be served from (their device decides the codec's path)."""
        return [t for t in [*self._exposed, self._packed, *((self._quant.fp8, self._quant.scales) if self._quant else ())]
                if t is not None]

    def _delta_space(self, space: int, index: int) -> torch.Tensor:
        """The bytes of one delta page space as served for the version being published (flat uint8)."""
        if space == Space.REGION:
            return _flat_bytes(self._exposed[index])
        if space == Space.PACKED:
            if self.ring is not None:
                with torch.no_grad():
                    self._packs[index]()
            return _flat_bytes(self._packed)
        return _flat_bytes(self._quant.fp8 if space == Space.FP8 else self._quant.scales)

    @property
    def delta_stats(self) -> DeltaStats | None:
        """The last publish's delta (density, bytes, encodings), None without delta syncs."""
        return self._delta.stats if self._delta else None

    @property
    def delta_extra_bytes(self) -> int:
        """Memory delta syncs cost this rank: the previous version of its pages, the delta region and its index."""
        return self._delta.extra_bytes if self._delta else 0

    def release(self, version: int, timeout: float | None = None) -> ReleaseReport:
        """Wait until the joined inference ranks and gathering peers finished reading `version` (or the timeout), then retire it.

        After this returns the trainer may change its tensors: a receiver or peer still reading sees
        the sequence word move and fails instead of keeping mixed bytes. An inference rank that does
        not answer in time is not waited for again until it talks or rejoins as a new process.
        """
        check_version(version)
        self._started()
        self.agent.background(False)  # the wait polls the agent itself
        start = time.monotonic()
        deadline = start + (self.options.timeout if timeout is None else timeout)
        left = self._refresh_joined()
        wait = ReleaseWait(self, version, start, deadline)
        wait.run()
        given_up = wait.waiting  # empty unless it timed out
        self._retire(version)
        for rank in given_up:
            self._live.discard(rank)
            self._given_up[rank] = self._joined.get(rank)
        report = wait.report(given_up, left)
        if report.timed_out:
            log.warning("trainer rank %d: version %d not acknowledged by inference ranks %s within the timeout",
                        self.rank, version, list(report.timed_out))
        if report.gatherers_timed_out:
            log.warning("trainer rank %d: trainer ranks %s had not gathered version %d within the timeout; they will "
                        "fail that version", self.rank, list(report.gatherers_timed_out), version)
        return report

    def _retire(self, version: int) -> None:
        """Retire `version` (a reader still reading sees the sequence word move); a later version pending gets its
        background poll back."""
        self._seq.fill_(2 * version + 1)
        if self._pending == version:
            self._pending = None
        elif self._pending is not None:
            self.agent.background(True)

    def _advance_ring(self, version: int, done: set[int], held: set[int]) -> None:
        """Pack the next ring chunks whose predecessor every live reader that is not done acknowledged; a returning
        reader held for (`held`, not yet live) holds the ring where it is, so that it finds chunk 0 still there."""
        while self._pending == version and self._ring_next < len(self._packs):
            chunk = self._ring_next - 1
            acked = {rank for rank, m in self._inbox if m == Message(Kind.RING, version, chunk)}
            if (self._chunk_readers[chunk] & (self._live | held)) - acked - done:
                return
            self._ring_word[1] = 2 * self._ring_next - 1
            with torch.no_grad():
                self._packs[self._ring_next]()
            self.device_sync.wait("ring chunk packed")
            self._ring_word[1] = 2 * self._ring_next
            self._ring_next += 1

    def _started(self) -> None:
        if not self.running:
            raise WeightplanError(f"trainer rank {self.rank}: call start() (or use the Sender in a with block) before "
                                  "publishing, and not after close()")

    def _poll(self) -> None:
        """Progress this agent (peers' READs need it without a progress thread), keeping the notifications for release()."""
        self._collect_messages()

    def _collect_messages(self) -> list[tuple[int, Message]]:
        """Every notification kept so far, the new ones included."""
        self._inbox += list(self._messages())
        return self._inbox

    def _forget_messages(self, version: int) -> None:
        """Keep only what concerns later versions, and `version`'s ring acks (the ring still advances on them)."""
        self._inbox = [(rank, m) for rank, m in self._inbox
                       if m.version > version or (m.version == version and m.kind is Kind.RING)]

    def _refresh_joined(self) -> tuple[int, ...]:
        """Wait for inference ranks that joined since the last check (each process has its own incarnation), and no
        longer for those whose incarnation left (protocol.left_key) or that joined with another plan (a rank of another
        inference size, before or after a resize: docs/operations.md); returns the ranks that left since the last check."""
        left = []
        for rank in self.readers:
            try:
                joined = protocol.joined_plan(self.rendezvous, rank)
                incarnation, plan = joined if joined is not None else (None, None)
                other = plan is not None and plan != self.plan.fingerprint
                gone = incarnation is not None and (
                    other or protocol.left_incarnation(self.rendezvous, rank) == incarnation)
            except SyncError as exc:  # one bad reader record never makes a trainer fail
                log.warning("trainer rank %d: ignoring inference rank %d's join: %s", self.rank, rank, exc)
                continue
            if other and self._other_plan.get(rank) != incarnation:
                self._other_plan[rank] = incarnation
                log.info("trainer rank %d: inference rank %d runs plan %s, not this one (%s): not waiting for it",
                         self.rank, rank, plan[:12], self.plan.fingerprint[:12])
            if gone:
                if self._joined.pop(rank, None) is not None:
                    left.append(rank)
                self._live.discard(rank)
                self._given_up.pop(rank, None)
            elif incarnation is not None:
                self._joined[rank] = incarnation
                if self._given_up.get(rank) != incarnation:
                    self._live.add(rank)
        if left:
            log.info("trainer rank %d: inference ranks %s left; not waiting for them", self.rank, left)
        return tuple(left)

    def _returning(self, version: int) -> list[int]:
        """Given-up inference ranks whose incarnation wrote that it is back to read `version` (a bad record is ignored)."""
        back = []
        for rank, incarnation in self._given_up.items():
            try:
                key = protocol.returning_key(rank, version)
                if self.rendezvous.exists(key) and self.rendezvous.get_text(key, protocol.INCARNATION) == incarnation:
                    back.append(rank)
            except SyncError as exc:
                log.warning("trainer rank %d: ignoring inference rank %d's return: %s", self.rank, rank, exc)
        return back

    def _messages(self):
        """Parsed notifications from inference ranks of this plan; anything else is dropped."""
        names = {protocol.inference(k).agent(self.rendezvous.job): k for k in self.readers}
        for rank, message in protocol.received(self.agent, names, _READER_MESSAGES, f"trainer rank {self.rank}"):
            self._live.add(rank)
            self._given_up.pop(rank, None)
            yield rank, message


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)

