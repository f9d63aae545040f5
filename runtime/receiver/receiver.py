"""The inference end of a sync: pulls its descriptors with one-sided NIXL READs, never keeps mixed versions."""

from __future__ import annotations

import logging
import time
import uuid

import numpy as np
import torch

from ..checks import check_host_only, check_no_aliases, check_tensors, check_version, flat_view, inference_names, named_tensors
from ..constant_writes import write_constants
from ..device import DeviceSync, current_stream
from ..errors import PlanMismatchError, SyncError, WeightplanError
from ..fp8.placement import fp8_placement
from ..options import SyncOptions
from ..plan.format import Plan
from ..tables.quant import check_supported, quant_tables
from ..tables.eplb import check_expert_map, eplb_reads
from ..tables.ranks import Reads, check_pool, held_entries, layout_rank
from ..tables.receiver import read_groups, read_tables, runs_into
from ..tables.ring import DEFAULT_RING_BYTES
from ..transport import protocol
from ..transport.lifecycle import AgentOwner
from ..transport.reader import Transport
from ..transport.rendezvous import Rendezvous
from ..delta.rates import DeltaRates
from .alternates import alternate_views
from .connections import TrainerConnections
from .delta import ReceiverDelta
from .derived import DerivedRefresh
from .quant import ReceiverQuant
from .reading import read_groups as read_group_phase, read_ring_chunks
from .report import ReceiverStats, SyncReport
from .second_hops import SecondHops
from .verify import Verifier

log = logging.getLogger("weightplan.runtime")
DEVICE_IPC = ("auto", "off")  # read trainers on this host directly when they open ("auto"), or always over NIXL
LEAVE_S = 5.0  # seconds close() gives the store to take this rank's left record (then its trainers time out on it once)


class Receiver(AgentOwner):
    """Inference `rank` of `plan`, writing into `destination` (a vLLM model or any module/dict with the planned parameters).

    `version` is the last version fully received, or None while the weights are incomplete (before
    the first sync, during a sync and after a failed one). `group_bytes` bounds the bytes of a
    pipeline group: group k+1 moves while the post-ops of group k run. Post-ops are the digest
    check (`verify`), quantizing this rank's own fp8 blocks (plans with fp8 tables; see
    runtime/receiver/quant.py) and `post_op(names)`, called with the destination names each group
    completed, in that order. After the last group, the derived post-load state the plan lists
    (MLA's absorbed `W_UK_T`/`W_UV`) is recomputed on `destination`'s modules with
    `process_weights_after_loading(act_dtype)` (runtime/receiver/derived.py); `derived="caller"` leaves
    that to the caller, and is required when `destination` is a dict of tensors.

    A trainer whose small runs exceed `ring_bytes` (default 512 MiB; give its Sender the same value)
    serves them through a bounded ring, chunk by chunk: they are read first, each chunk as soon as
    its trainer's ring word says it is in the ring, and acknowledged so the trainer packs the next.

    With node-local fan-out (a plan compiled with `gpus-per-node`), this rank reads from the trainers
    only the entries it pulls for its node (`plan.pulling`); once that first hop landed it tells its
    peers so, then READs its other replicated entries whole from their pullers on its node
    (runtime/receiver/second_hops.py) and calls `post_op` once more with their names. A puller that
    fails or dies fails the sync of the peers that depend on it, naming it.

    With `delta` (a fraction in (0, 1]; give the trainers' Senders `delta` too), a sync whose trainers published a
    delta of the version this rank holds, from the incarnation it synced that version from, READs each such
    trainer's page index and then only the encoded changes, decodes every one of them, and only then writes them
    into the destination (runtime/receiver/delta.py); `SyncReport.took` says whether it took "delta", "full" or a
    "mixed" sync. Without a current version (first sync, after a failed one, a new process) it takes the version
    full, and after `write_constants()` (which a caller that wrote the destination itself calls) too.

    The plan's constants (vLLM's zero padding rows) are written once, at `start()`, before any sync: no
    READ touches their bytes, so a sync, failed or not, leaves them intact. The destination is the
    caller's memory, though: a caller that writes it itself (vLLM's own `load_weights`, a dummy
    initialisation, a kernel repacking in place) calls `write_constants()` before the next sync.

    With fp8 tables, the bf16 staging slots live on the destinations' device (all on one device) and this rank's
    blocks are quantized there in torch ops on a GPU, in the numba kernel in host memory; `fp8_path="device"` makes
    host destinations take the GPU's path (how the tests prove it here; runtime/fp8/placement.py).

    `alternates` are more destination sets of the destination's geometry (same names, shapes, dtypes, contiguous, on
    the same device, no memory shared with any other set): every set is registered with NIXL and gets its READ
    descriptor lists prepared once, at `start()` and at the first sync from each trainer incarnation, and
    `sync(version, into=k)` fills set k only (0: `destination`). A caller alternating between two copies of its
    weights (e.g. two LoRA slots, runtime/lora_slots.py) so pays no per-version agent, registration or connection.
    `versions` says which version each set holds. Alternates are refused with fp8 staging, fan-out, delta and
    derived='refresh', whose state belongs to one set.

    In a job with a secret, a trainer on this host is read without NIXL unless `device_ipc="off"` (default "auto"), only
    within the memory it registered with NIXL and with its identity checked before every READ: its host memory with
    process_vm_readv, its GPU memory opened once over CUDA IPC and copied on this rank's current stream
    (runtime/transport/local_peer.py); notifications still go over NIXL. A trainer that cannot be opened so (another
    host, no permission, a handle refused) is read over NIXL, logged once. `SyncReport.paths` says which path moved
    how many bytes.

    `pool_ranks` (default: the plan's inference ranks; give the trainers' Senders the same) lets `rank` be a DP replica
    beyond the plan's ranks: `rank` stays this process's name in every record, agent and message, while its tables are
    those of `plan_rank`, the plan rank at its place in DP replica 0 (runtime/tables/ranks.py `layout_rank`; plans with
    expert parallelism or fan-out are refused).

    A plan compiled for vLLM's expert load balancer (`--inference ...,ep,eplb=R`) needs `expert_map`, the engine's
    current physical-to-logical table ([MoE layers, physical slots] of logical expert ids, vLLM's
    `EplbModelState.physical_to_logical_map`): each local expert slot is read with the bytes of the logical expert the
    table puts there (runtime/tables/eplb.py). The table is fixed for the Receiver's life (`expert_map`); after the
    engine rearranges its experts, make a new Receiver with the new table (vllm_backend does so at the next sync).

    `timeout`, `verify`, `progress`, `ring_bytes`, `delta`, `fp8_path`, `delta_path` and `pool_ranks` mean what they
    mean to the Sender (one record, `options`: runtime/options.py); `stats` holds this rank's fixed sizes
    (runtime/receiver/report.py).

    The constructor only checks the destination against the plan and builds this rank's tables
    (runtime/tables/receiver.py); `start()` registers the destination with NIXL, writes the constants
    and joins, `close()` deregisters it, releases the agent and says this process left (the trainers' next release
    does not wait for it). `with Receiver(...) as receiver:` does both.
    """

    def __init__(self, plan: Plan, rank: int, destination, *, rendezvous: Rendezvous, timeout: float = 60.0,
                 verify: bool = False, group_bytes: int = 256 << 20, post_op=None, progress: str = "auto",
                 derived: str = "refresh", act_dtype: torch.dtype = torch.bfloat16, ring_bytes: int = DEFAULT_RING_BYTES,
                 delta: float = 0.0, fp8_path: str = "auto", alternates: tuple = (), delta_path: str = "auto",
                 delta_rates: DeltaRates | None = None, device_ipc: str = "auto", pool_ranks: int | None = None,
                 expert_map=None):
        if device_ipc not in DEVICE_IPC:
            raise WeightplanError(f"inference rank {rank}: device_ipc must be one of {', '.join(DEVICE_IPC)}, not {device_ipc!r}")
        # `rank` names this process (records, agent, messages); `plan_rank` is whose tables it uses.
        self.plan_rank = layout_rank(plan, rank, pool_ranks)
        self.options = SyncOptions(timeout=timeout, verify=verify, progress=progress, ring_bytes=ring_bytes, delta=delta,
                                   fp8_path=fp8_path, delta_path=delta_path, pool_ranks=check_pool(plan, pool_ranks))
        if plan.staging:
            check_supported(plan)
        self.plan, self.rank, self.rendezvous, self.post_op = plan, rank, rendezvous, post_op
        pull = self._pull = plan.pulling  # what this rank reads from the trainers (with fan-out, its first hops)
        held = np.flatnonzero(held_entries(plan, self.plan_rank)).tolist()
        self._dst = self._destination_views(destination, held)
        self._derived = DerivedRefresh(plan, {plan.dests[i].name for i in held}, destination, derived, act_dtype)
        # fp8 staging slots live on the destinations' device and are quantized there (runtime/fp8/placement.py).
        fp8 = fp8_placement(self._dst.values() if plan.staging else (), fp8_path, f"inference rank {rank}")
        self._qt = quant_tables(pull) if plan.staging else None
        self._quant = ReceiverQuant(pull, self.plan_rank, self._qt, self._dst, fp8) if self._qt else None
        self._hops = SecondHops(plan, self.plan_rank, self._dst, rendezvous)  # fan-out has no pool: plan_rank is rank
        # Alternate destination sets (identical geometry) a sync may fill instead: `sync(version, into=k)`.
        self._dsts = alternate_views(plan, rank, held, self._dst, alternates, {
            "fp8 staging": bool(plan.staging), "node-local fan-out": bool(self._hops.entries or self._hops.served),
            "delta": bool(delta), "derived='refresh'": bool(self._derived.modules)})
        check_host_only([t for views in self._dsts[1:] for t in views.values()], {"verify=True": verify},
                        f"inference rank {rank}")
        self._held: list[int | None] = [None] * len(self._dsts)  # the version each destination set holds whole
        self.expert_map = self._check_eplb(expert_map, alternates)
        self._groups = read_groups(pull, self.plan_rank, group_bytes, self._quant.grouping() if self._quant else None,
                                   None if self.expert_map is None else eplb_reads(pull, self.plan_rank, self.expert_map))
        if self._quant:
            self._quant.place(self._groups.stage_group, self.n_groups)
        self._build_tables(ring_bytes)
        if self.expert_map is not None and self._tables.slot_bytes != self._tables.packed_bytes:
            raise WeightplanError(f"inference rank {rank}: EPLB with a trainer serving its small runs through a ring: "
                                  f"give every Sender and this Receiver a ring_bytes of at least "
                                  f"{max(self._tables.packed_bytes.values())}")
        # Delta syncs: `delta` is the fraction of the pages it reads from each trainer that its delta staging holds.
        self._delta = (ReceiverDelta(pull, rank, self._qt, ring_bytes, self._tables, self._dst, delta, delta_path,
                                     delta_rates) if delta else None)
        self.connections = TrainerConnections(
            plan, rank, rendezvous, sources=list(self.reads), tables=self._tables, local_rows=self._local_rows,
            quant_tables=self._qt, delta=self._delta, hops=self._hops, verify=verify, ring_bytes=ring_bytes,
            progress=self.options.progress, device_ipc=device_ipc)
        # The trainers' runs into second-hop entries, by trainer rank: what their digests cover (verify=True).
        hop_reads = runs_into(plan, self.plan_rank, self._hops.entries) if self._hops.entries else {}
        self._verifier = Verifier(plan, rendezvous, self.reads, self._groups, hop_reads, self._quant) if verify else None
        # Quantized groups and derived state are computed on the destinations' device; they are waited for before the
        # staging slot is reused, before the ack / landed word, and before `version` is set (runtime/device.py).
        self.device_sync = DeviceSync.of([*(t for views in self._dsts for t in views.values()),
                                          *(self._quant.slots if self._quant else [])], current_stream)
        self._synced: dict[int, str] = {}  # trainer rank -> the incarnation this rank's current version came from
        self._version: int | None = None
        self._acked: int | None = None  # the last version this process acked to the trainers, kept across failed syncs
        self.incarnation = uuid.uuid4().hex
        self.stats = self._stats()

    def _check_eplb(self, expert_map, alternates) -> np.ndarray | None:
        """The engine's physical-to-logical expert table an EPLB plan's reads are mapped through (runtime/tables/eplb.py),
        checked against the plan; None for other plans. Refuses what EPLB does not support yet, in one line."""
        eplb, where = self.plan.header.inference.eplb, f"inference rank {self.rank}"
        if eplb is None:
            if expert_map is not None:
                raise PlanMismatchError(f"{where}: expert_map is given, but plan {self.plan.fingerprint[:12]} was not "
                                        "compiled for EPLB (compile-plan --inference ...,ep,eplb=R)")
            return None
        if expert_map is None:
            raise PlanMismatchError(f"{where}: plan {self.plan.fingerprint[:12]} is for an engine with EPLB: pass "
                                    "expert_map, the engine's current [MoE layers, physical slots] table of logical experts")
        unsupported = {"verify=True": self.options.verify, "delta": bool(self.options.delta), "alternates": bool(alternates),
                       "node-local fan-out": self.plan.fanout is not None, "fp8 staging": bool(self.plan.staging)}
        refused = [what for what, used in unsupported.items() if used]
        if refused:
            raise WeightplanError(f"{where}: EPLB plans do not support {', '.join(refused)} yet")
        return check_expert_map(self.plan, expert_map, where)

    def _destination_views(self, destination, held: list[int]) -> dict[int, torch.Tensor]:
        """Flat views of the planned entries this rank holds, by plan entry, once `destination` matches the plan."""
        plan, rank = self.plan, self.rank
        expected = {plan.dests[i].name: (plan.dests[i].shape, plan.dests[i].dtype) for i in held}
        given = named_tensors(destination, set(expected))
        check_tensors(given, expected, set(expected) | inference_names(plan, self.plan_rank), f"inference rank {rank}")
        views = {i: flat_view(plan.dests[i].name, given[plan.dests[i].name], plan.dests[i].shape, plan.dests[i].dtype,
                              f"inference rank {rank}") for i in held}
        check_no_aliases({plan.dests[i].name: view for i, view in views.items()}, f"inference rank {rank}")
        check_host_only(views.values(), {"verify=True": self.options.verify}, f"inference rank {rank}")
        return views

    def _build_tables(self, ring_bytes: int) -> None:
        """This rank's READ tables (runtime/tables/receiver.py) for every destination set: they differ only in their local
        addresses, kept per set (`_local_rows`) and prepared once, when the agent is made."""
        quant = {src: self._quant.descriptors(src) for src in self._quant.rows} if self._quant else {}
        try:
            tables = [read_tables(self._pull, self._groups, _addresses(self.plan, views), ring_bytes, quant)
                      for views in self._dsts]
        except ValueError as exc:
            raise WeightplanError(f"inference rank {self.rank}: {exc}") from None
        self._tables = tables[0]
        self._local_rows = [{src: t.local for src, t in set_tables.descriptors.items()} for set_tables in tables]

    def _stats(self) -> ReceiverStats:
        table_bytes = self._tables.table_bytes + sum(rows.nbytes for local in self._local_rows[1:] for rows in local.values())
        constant_bytes = sum(c.length * self._dst[c.dest].element_size() for c in self.plan.constants
                             if self.plan_rank in self._pull.dests[c.dest].ranks)
        return ReceiverStats(
            bytes=int(sum(int(r.total().sum()) for r in self.reads.values())) + (self._quant.bytes if self._quant else 0),
            descriptors=sum(len(t) for t in self._tables.descriptors.values()), table_bytes=table_bytes,
            packed_read_bytes=self._tables.packed_read_bytes, constant_bytes=constant_bytes,
            destination_bytes=sum(t.numel() * t.element_size() for t in self._dst.values()),
            staging_bytes=self._quant.staging_bytes if self._quant else 0)

    @property
    def agent(self) -> Transport | None:
        """This rank's NIXL agent, made with the destinations registered by start() (runtime/receiver/connections.py)."""
        return self.connections.agent

    def start(self) -> "Receiver":
        """Register the destinations with a new NIXL agent, write the plan's constants and join the job; returns self.

        Side effects live here, not in the constructor (which only checks the destination against the
        plan): call it once before `sync`, or use the receiver as a context manager, which also closes it.
        """
        if self.agent is not None:
            raise WeightplanError(f"inference rank {self.rank}: this Receiver was started already")
        self.connections.open([t for views in self._dsts for t in views.values()] + self.connections.words
                              + (self._quant.slots if self._quant else []) + self._hops.registered
                              + (self._delta.registered if self._delta else []))
        self.write_constants()  # with the destinations registered, before this rank says it joined
        me = protocol.inference(self.rank)
        if self._hops.served:  # peers of this node read entries from this rank (fan-out)
            self.rendezvous.put(me.metadata_key(self.incarnation), self.agent.metadata())
            self.rendezvous.put(me.info_key(self.incarnation), self._hops.info())
        self.rendezvous.put(protocol.joined_key(self.rank), protocol.joined_record(self.incarnation, self.agent.name,
                                                                                   self.plan.fingerprint))
        return self

    def close(self) -> None:
        """Drop every trainer peer, deregister the destinations and release the agent, then say this process left the
        job (protocol.left_key): the trainers' next release does not wait for it; idempotent.

        With fan-out, it first waits (at most the timeout) for this node's peers still reading the last version from it.

        The destination keeps the bytes of the last version (`version` says which, None if incomplete).
        """
        if not self.running:
            return
        try:
            self.connections.close(time.monotonic() + self.options.timeout)  # peers may still read its last version
        finally:
            self._leave()

    def _leave(self) -> None:
        """Write this incarnation's left record, within LEAVE_S; a store that does not take it is logged (the trainers
        then stop waiting for this rank after one release timeout, as for a process that died)."""
        try:
            self.rendezvous.put(protocol.left_key(self.rank), protocol.left_record(self.incarnation), timeout=LEAVE_S)
        except SyncError as exc:
            log.warning("inference rank %d left without telling the trainers (%s): their next release waits for it up to "
                        "its timeout", self.rank, exc)

    @property
    def version(self) -> int | None:
        return self._version

    @property
    def versions(self) -> tuple[int | None, ...]:
        """The version each destination set holds whole (0: the destination, then the alternates); None: none yet, or
        its last sync failed."""
        return tuple(self._held)

    @property
    def reads(self) -> dict[int, Reads]:
        """What this rank reads from each trainer rank (runtime/tables/receiver.py `read_groups`)."""
        return self._groups.reads

    @property
    def n_groups(self) -> int:
        return self._groups.n_groups

    def write_constants(self, into: int | None = None) -> int:
        """(Re)write the plan's constant runs into this rank's destinations (not into second-hop entries, which arrive
        whole from their puller); returns the bytes written. A caller that wrote the destination itself calls this,
        so the next sync takes its version full: a delta applies only to bytes this rank's last sync left.
        With alternate destinations, `into` names the one set to write (default: every set)."""
        self._synced = {}
        sets = range(len(self._dsts)) if into is None else [self._check_into(into)]
        return sum(write_constants(self._pull, self.plan_rank, self._dsts[k].__getitem__) for k in sets)

    def _check_into(self, into) -> int:
        if isinstance(into, bool) or not isinstance(into, int) or not 0 <= into < len(self._dsts):
            raise WeightplanError(f"inference rank {self.rank}: destination set {into!r} does not exist: this Receiver "
                                  f"has {len(self._dsts)} (0: the destination, 1..: its alternates)")
        return into

    def sync(self, version: int, into: int = 0) -> SyncReport:
        """Receive `version` from every trainer rank this rank reads; raise SyncError (weights incomplete) on failure.

        `into` chooses the destination set written (0: the destination, k: alternate k); the other sets are not touched,
        and a failed sync leaves only set `into` incomplete (`versions`). Waiting for the trainers to publish `version`
        and reading it have `timeout` each."""
        check_version(version)
        self._check_into(into)
        if not self.running:
            raise WeightplanError(f"inference rank {self.rank}: call start() (or use the Receiver in a with block) "
                                  "before syncing, and not after close()")
        previous, self._version, self._held[into] = self._version, None, None
        synced, self._synced = self._synced, {}
        try:
            report = self._sync(version, previous, synced, into)
            self._held[into] = version
            return report
        except (SyncError, PlanMismatchError) as exc:
            self._hops.failed(version)
            self.connections.fail(version)
            self._hops.drop(version)
            raise type(exc)(f"inference rank {self.rank}: sync of version {version} failed; its weights are "
                            f"incomplete until a later sync succeeds: {exc}") from None

    def _sync(self, version: int, previous: int | None, synced: dict[int, str], into: int) -> SyncReport:
        start = time.monotonic()
        deadline = start + self.options.timeout
        self._hops.writing(version, deadline)  # before any byte of this version lands: peers are done with the last
        sources = sorted(self.reads)
        self.rendezvous.wait([protocol.version_key(r, version) for r in sources], deadline - time.monotonic(),
                             f"version {version} from trainer ranks {sources}")
        waited = time.monotonic()
        # The reading gets its own timeout: the trainers may have waited out their release timeout for a reader cut
        # off (once), and the readers still connected must not fail this version for it.
        deadline = waited + self.options.timeout
        incarnations = {r: self.rendezvous.get_text(protocol.version_key(r, version), protocol.INCARNATION) for r in sources}
        if self.connections.may_be_given_up(version, self._acked):
            self.rendezvous.put(protocol.returning_key(self.rank, version), self.incarnation.encode())
        connected = self.connections.connect(version, incarnations, deadline)
        trainers = self.connections.trainers.by_rank
        if self._verifier:
            self._verifier.start(version, deadline, list(trainers), self._dsts[into])
        if self._quant and self._quant.begin():
            self.device_sync.wait("staging slots zeroed")  # before READs land in them
        took, delta_read, choices = (self._delta.take(self.connections.reader, self.rendezvous, trainers, version, previous,
                                                      synced, deadline) if self._delta else (set(), {}, ()))
        read_ring_chunks(self.connections, version, deadline, took, into)
        times = read_group_phase(self.connections, self.n_groups, version, start, deadline, self._post_ops(), took, into)
        if self._quant:
            self._quant.end()
        self.connections.check_sequence(version, deadline, "after reading")
        self.connections.notify_all(protocol.ack(version))
        self._acked = version
        self._receive_second_hops(version, deadline)
        self._derived()  # after the ack: it reads only this rank's memory, so the trainers need not wait
        self.device_sync.wait("derived state")
        self._version = version
        self._synced = self.connections.incarnations()
        report = SyncReport.build(
            version, self.rank, self.stats, sources=sources, groups=self.n_groups,
            moments=(start, waited, connected, time.monotonic()), took=took,
            deltable_bytes=sum(t.deltable_bytes for r, t in trainers.items() if r in took), delta_read=delta_read,
            choices=choices, paths=self.connections.paths(took, delta_read), reading=times.reading,
            read_seconds=times.seconds, verify_seconds=self._verifier.seconds if self._verifier else None,
            quantize_seconds=self._quant.seconds if self._quant else 0.0, derived_seconds=self._derived.seconds,
            second_hop_bytes=self._hops.bytes, second_hop_seconds=self._hops.seconds if self._hops.inbound else 0.0)
        report.log(quantized=bool(self._quant and self._quant.quantizes))
        return report

    def _receive_second_hops(self, version: int, deadline: float) -> None:
        """With fan-out: say this rank's first hop landed, READ its other replicated entries from their pullers on this
        node (checked and passed to `post_op` like a group), and wait until this node's peers read what it pulled."""
        self._hops.landed(version)
        if self._hops.inbound:
            self._hops.receive(version, deadline)
            if self._verifier:
                self._verifier("second hops")
            if self.post_op is not None:
                self.post_op(sorted(self.plan.dests[d].name for d in self._hops.entries))
        self._hops.settle(deadline)  # this node's peers read what this rank pulled for them

    def _post_ops(self):
        """What runs on each group once its bytes landed: the digest check, this rank's fp8 quantization, `post_op`."""
        check = self._verifier
        quantize = self._quant.quantize if self._quant and self._quant.quantizes else None
        if check is None and self.post_op is None and quantize is None:
            return None

        def run(group: int) -> None:
            if check is not None:
                check(group)
            if quantize is not None:
                quantize(group)
                self.device_sync.wait("quantized a group")
            if self.post_op is not None:
                self.post_op(self._groups.names[group])

        return run


def _addresses(plan: Plan, views: dict[int, torch.Tensor]) -> np.ndarray:
    """Each plan entry's address in one destination set (0 for entries this rank does not hold)."""
    addresses = np.zeros(len(plan.dests), dtype=np.int64)
    addresses[list(views)] = [t.data_ptr() for t in views.values()]
    return addresses
