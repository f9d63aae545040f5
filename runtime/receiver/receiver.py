"""The inference end of a sync: pulls its descriptors with one-sided NIXL READs, never keeps mixed versions."""

from __future__ import annotations

import gc
import logging
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

from ..checks import check_host_only, check_no_aliases, check_tensors, check_version, flat_view, inference_names, named_tensors
from ..constant_writes import write_constants
from ..device import DeviceSync, current_stream
from ..errors import PlanMismatchError, SyncError, WeightplanError
from ..fp8.placement import fp8_placement
from ..plan.format import Plan
from ..tables.quant import check_supported, quant_tables, stage_packing
from ..tables.ranks import Reads, RemoteRegion, held_entries, region_addresses
from ..tables.receiver import read_groups, read_tables, runs_into
from ..tables.ring import DEFAULT_RING_BYTES
from ..transport import protocol
from ..transport.lifecycle import AgentOwner
from ..transport.local_peer import HOST_READ, UNSIGNED, NotLocal, Registered, open_local
from ..transport.nixl_agent import Backoff, NixlAgent, PeerLost, Unreachable
from ..transport.peer import Connections, Peer, check_sequence
from ..transport.peer_check import checked_regions, region_fields
from ..transport.reader import Routed, Transport
from ..transport.region_digests import byte_view, run_digests
from ..transport.rendezvous import Rendezvous
from .alternates import alternate_views
from ..delta.rates import DeltaChoice, DeltaRates
from .delta import ReceiverDelta
from .derived import DerivedRefresh
from .quant import ReceiverQuant
from .second_hops import SecondHops

log = logging.getLogger("weightplan.runtime")
PROGRESS_EVERY = 5.0  # seconds between progress lines of a long sync
# A trainer UCX could not connect to is tried again, after CONNECT_RETRY_S doubling up to 1 s, for at most
# CONNECT_PATIENCE_S (within the sync's timeout): a refusal that clears heals within the sync, a trainer that is gone
# costs the sync this much, not its whole timeout.
CONNECT_RETRY_S = 0.05
CONNECT_PATIENCE_S = 10.0
DEVICE_IPC = ("auto", "off")  # read trainers on this host directly when they open ("auto"), or always over NIXL


@dataclass(frozen=True)
class SyncReport:
    """One completed sync on one inference rank."""

    version: int
    rank: int
    bytes: int
    descriptors: int
    trainer_ranks: int
    groups: int
    seconds: float
    verify_seconds: float | None
    quantize_seconds: float = 0.0  # receiver-side fp8 quantization, inside `seconds`
    derived_seconds: float = 0.0  # recomputing derived post-load state (runtime/receiver/derived.py), inside `seconds`
    table_bytes: int = 0  # this rank's runtime tables (reads, groups, descriptors): O(stored runs + descriptors)
    packed_bytes: int = 0  # of `bytes`, those read from the trainers' packed regions of small runs
    second_hop_bytes: int = 0  # read from pullers of this node (fan-out), not in `bytes`
    second_hop_seconds: float = 0.0  # waiting for and reading them, inside `seconds`
    # Straggler report over the grouped READs (not ring chunks or second hops): the trainer rank whose READs stayed
    # outstanding longest (summed over groups, from posting to done), and that time as a share of the grouped READs'
    # wall time (at most 1; groups in flight together can count twice); None without grouped READs.
    slowest_trainer: int | None = None
    slowest_share: float = 0.0
    # Delta syncs (runtime/receiver/delta.py): "delta" when every trainer rank's bytes came as a delta of the previous
    # version, "full" when none did, "mixed" otherwise; which trainer ranks sent deltas, and the delta bytes READ
    # (page indexes and blobs, inside `bytes`).
    took: str = "full"
    delta_trainers: tuple[int, ...] = ()
    delta_bytes: int = 0
    # Per trainer whose delta applied and fit: whether it was taken or declined as predicted slower than reading the
    # same bytes full, with the prediction (runtime/delta/rates.py); `why` says it in words.
    delta_choices: tuple[DeltaChoice, ...] = ()
    # Fixed costs inside `seconds`: waiting for the trainers' version records, and connecting to trainer incarnations
    # not seen before (their info and agent metadata loaded, their descriptor lists and READs prepared).
    wait_seconds: float = 0.0
    connect_seconds: float = 0.0
    # `bytes` by the path that moved them: "nixl", or for trainers on this host "process_vm_readv" (their host memory)
    # and "cuda_ipc" (their GPU memory) (runtime/transport/local_peer.py; Receiver's `device_ipc`).
    paths: dict[str, int] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    @property
    def why(self) -> str:
        """Why each trainer's bytes came as a delta or full, where a delta was on offer."""
        return "; ".join(c.why for c in self.delta_choices)


@dataclass(frozen=True)
class _Trainer:
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

    The constructor only checks the destination against the plan and builds this rank's tables
    (runtime/tables/receiver.py); `start()` registers the destination with NIXL, writes the constants
    and joins, `close()` deregisters it and releases the agent. `with Receiver(...) as receiver:` does both.
    """

    def __init__(self, plan: Plan, rank: int, destination, *, rendezvous: Rendezvous, timeout: float = 60.0,
                 verify: bool = False, group_bytes: int = 256 << 20, post_op=None, progress_thread: bool = False,
                 derived: str = "refresh", act_dtype: torch.dtype = torch.bfloat16, ring_bytes: int = DEFAULT_RING_BYTES,
                 delta: float = 0.0, fp8_path: str = "auto", alternates: tuple = (), delta_path: str = "auto",
                 delta_rates: DeltaRates | None = None, device_ipc: str = "auto"):
        if device_ipc not in DEVICE_IPC:
            raise WeightplanError(f"inference rank {rank}: device_ipc must be one of {', '.join(DEVICE_IPC)}, not {device_ipc!r}")
        self.device_ipc = device_ipc
        self._ring_bytes = ring_bytes
        held = held_entries(plan, rank)
        if plan.staging:
            check_supported(plan)
        self.plan, self.rank, self.rendezvous, self.timeout, self.verify = plan, rank, rendezvous, timeout, verify
        pull = self._pull = plan.pulling  # what this rank reads from the trainers (with fan-out, its first hops)
        self.post_op = post_op
        expected = {plan.dests[i].name: (plan.dests[i].shape, plan.dests[i].dtype) for i in np.flatnonzero(held)}
        given = named_tensors(destination, set(expected))
        check_tensors(given, expected, set(expected) | inference_names(plan, rank), f"inference rank {rank}")
        self._dst = {int(i): flat_view(plan.dests[i].name, given[plan.dests[i].name], plan.dests[i].shape,
                                       plan.dests[i].dtype, f"inference rank {rank}") for i in np.flatnonzero(held)}
        check_no_aliases({plan.dests[i].name: view for i, view in self._dst.items()}, f"inference rank {rank}")
        check_host_only(self._dst.values(), {"verify=True": verify}, f"inference rank {rank}")
        self._derived = DerivedRefresh(plan, set(expected), destination, derived, act_dtype)
        # fp8 staging slots live on the destinations' device and are quantized there (runtime/fp8/placement.py).
        fp8 = fp8_placement(self._dst.values() if plan.staging else (), fp8_path, f"inference rank {rank}")
        self._qt = quant_tables(pull) if plan.staging else None
        self._quant = ReceiverQuant(pull, rank, self._qt, self._dst, fp8) if self._qt else None
        self._hops = SecondHops(plan, rank, self._dst, rendezvous)
        # The trainers' runs into second-hop entries, by trainer rank: what their digests cover (verify=True).
        self._hop_reads = runs_into(plan, rank, self._hops.entries) if self._hops.entries else {}
        # Alternate destination sets (identical geometry) a sync may fill instead: `sync(version, into=k)`.
        self._dsts = alternate_views(plan, rank, np.flatnonzero(held).tolist(), self._dst, alternates, {
            "fp8 staging": bool(plan.staging), "node-local fan-out": bool(self._hops.entries or self._hops.served),
            "delta": bool(delta), "derived='refresh'": bool(self._derived.modules)})
        check_host_only([t for views in self._dsts[1:] for t in views.values()], {"verify=True": verify},
                        f"inference rank {rank}")
        self._held: list[int | None] = [None] * len(self._dsts)  # the version each destination set holds whole
        self._groups = read_groups(pull, rank, group_bytes, self._quant.grouping() if self._quant else None)
        if self._quant:
            self._quant.place(self._groups.stage_group, self.n_groups)
        self._seq = torch.zeros(plan.header.src_ranks, dtype=torch.int64)
        self._ring_word = torch.zeros((plan.header.src_ranks, 2), dtype=torch.int64)
        quant = {src: self._quant.descriptors(src) for src in self._quant.rows} if self._quant else {}
        try:
            tables = [read_tables(pull, self._groups, _addresses(plan, views), ring_bytes, quant) for views in self._dsts]
        except ValueError as exc:
            raise WeightplanError(f"inference rank {rank}: {exc}") from None
        self._tables = tables[0]
        # Every set's tables differ only in their local addresses: those are kept per set, prepared once at start().
        self._local_rows = [{src: t.local for src, t in set_tables.descriptors.items()} for set_tables in tables]
        # Delta syncs: `delta` is the fraction of the pages it reads from each trainer that its delta staging holds.
        self._delta = (ReceiverDelta(pull, rank, self._qt, ring_bytes, self._tables, self._dst, delta, delta_path,
                                     delta_rates) if delta else None)
        self._synced: dict[int, str] = {}  # trainer rank -> the incarnation this rank's current version came from
        self._trainers: Connections[_Trainer] = Connections(self._connect)
        # Quantized groups and derived state are computed on the destinations' device; they are waited for before the
        # staging slot is reused, before the ack / landed word, and before `version` is set (runtime/device.py).
        self.device_sync = DeviceSync.of([*(t for views in self._dsts for t in views.values()),
                                          *(self._quant.slots if self._quant else [])], current_stream)
        self._version: int | None = None
        self._acked: int | None = None  # the last version this process acked to the trainers, kept across failed syncs
        self._reading: dict[int, float] = {}  # trainer rank -> seconds its grouped READs were outstanding, this sync
        self._read_seconds = 0.0  # the grouped READs' phase of this sync, wall time
        self.incarnation = uuid.uuid4().hex
        self.agent: Transport | None = None  # created, with the destinations registered, by start()
        self.reader: Routed | None = None  # READs through the agent or a trainer's LocalReader, from start()
        self._registered: list[torch.Tensor] = []
        self._not_local: set[tuple[int, str]] = set()  # (trainer rank, why) already logged
        self._unreachable: set[str] = set()  # trainer incarnations already logged as unreachable
        self._progress_thread = progress_thread

    def start(self) -> "Receiver":
        """Register the destinations with a new NIXL agent, write the plan's constants and join the job; returns self.

        Side effects live here, not in the constructor (which only checks the destination against the
        plan): call it once before `sync`, or use the receiver as a context manager, which also closes it.
        """
        if self.agent is not None:
            raise WeightplanError(f"inference rank {self.rank}: this Receiver was started already")
        self._registered = ([t for views in self._dsts for t in views.values()] + [self._seq, self._ring_word]
                            + (self._quant.slots if self._quant else []) + self._hops.registered
                            + (self._delta.registered if self._delta else []))
        self._new_agent()
        self.write_constants()  # with the destinations registered, before this rank says it joined
        me = protocol.inference(self.rank)
        if self._hops.served:  # peers of this node read entries from this rank (fan-out)
            self.rendezvous.put(me.metadata_key(self.incarnation), self.agent.metadata())
            self.rendezvous.put(me.info_key(self.incarnation), self._hops.info())
        self.rendezvous.put(protocol.joined_key(self.rank), protocol.joined_record(self.incarnation, self.agent.name))
        return self

    def close(self) -> None:
        """Drop every trainer peer, deregister the destinations and release the agent; idempotent.

        With fan-out, it first waits (at most the timeout) for this node's peers still reading the last version from it.

        The destination keeps the bytes of the last version (`version` says which, None if incomplete).
        """
        if not self.running:
            return
        self._close_agent(time.monotonic() + self.timeout)  # peers of this node may still read its last version

    def _new_agent(self) -> None:
        """A new NIXL agent (a new UCX worker) with this rank's memory registered and its local descriptor lists."""
        self.agent = NixlAgent(protocol.inference(self.rank).agent(self.rendezvous.job), self._progress_thread)
        self.agent.register(self._registered)
        self.reader = Routed(self.agent)
        self._hops.start(self.agent)
        if self._delta:
            self._delta.start(self.agent)
        self._local = [{src: self.agent.prepare(None, np.stack([rows[src], t.nbytes], axis=1))
                        for src, t in self._tables.descriptors.items()} for rows in self._local_rows]
        self._seq_local = {src: self.agent.prepare(None, np.array([[self._seq.data_ptr() + 8 * src, 8]])) for src in self.reads}
        self._ring_local = {src: self.agent.prepare(None, np.array([[self._ring_word[src].data_ptr(), 16]])) for src in self.reads}

    def _close_agent(self, deadline: float) -> None:
        """Drop every peer, release the local lists and close the agent (its UCX worker and every connection it held)."""
        self._trainers.drop_all()
        self._hops.close(deadline)
        for prepared in [*(p for local in self._local for p in local.values()), *self._seq_local.values(),
                         *self._ring_local.values()]:
            self.agent.release_list(prepared)
        if self._delta:
            self._delta.release(self.agent)
        self.agent.close()
        self._local, self._seq_local, self._ring_local = [], {}, {}

    def _renew_agent(self) -> None:
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
        self._close_agent(time.monotonic())
        gc.collect()  # the old agent's handles hold its worker: destroy it (its sockets) now
        self._new_agent()

    @property
    def version(self) -> int | None:
        return self._version

    @property
    def reads(self) -> dict[int, Reads]:
        """What this rank reads from each trainer rank (runtime/tables/receiver.py `read_groups`)."""
        return self._groups.reads

    @property
    def n_groups(self) -> int:
        return self._groups.n_groups

    @property
    def table_bytes(self) -> int:
        """Every table this rank built, the trainers' packings it derived included: none has a row dimension (each
        alternate destination set adds its own local addresses)."""
        return self._tables.table_bytes + sum(rows.nbytes for local in self._local_rows[1:] for rows in local.values())

    @property
    def packed_read_bytes(self) -> int:
        return self._tables.packed_read_bytes

    def write_constants(self, into: int | None = None) -> int:
        """(Re)write the plan's constant runs into this rank's destinations (not into second-hop entries, which arrive
        whole from their puller); returns the bytes written. A caller that wrote the destination itself calls this,
        so the next sync takes its version full: a delta applies only to bytes this rank's last sync left.
        With alternate destinations, `into` names the one set to write (default: every set)."""
        self._synced = {}
        sets = range(len(self._dsts)) if into is None else [self._check_into(into)]
        return sum(write_constants(self._pull, self.rank, self._dsts[k].__getitem__) for k in sets)

    def _check_into(self, into) -> int:
        if isinstance(into, bool) or not isinstance(into, int) or not 0 <= into < len(self._dsts):
            raise WeightplanError(f"inference rank {self.rank}: destination set {into!r} does not exist: this Receiver "
                                  f"has {len(self._dsts)} (0: the destination, 1..: its alternates)")
        return into

    @property
    def versions(self) -> tuple[int | None, ...]:
        """The version each destination set holds whole (0: the destination, then the alternates); None: none yet, or
        its last sync failed."""
        return tuple(self._held)

    @property
    def constant_bytes(self) -> int:
        """Bytes of this rank's destinations the plan's constants write (never READ)."""
        return sum(c.length * self._dst[c.dest].element_size() for c in self.plan.constants
                   if self.rank in self._pull.dests[c.dest].ranks)

    @property
    def bytes(self) -> int:
        """Bytes READ per sync: runs, plus with fp8 tables the fp8 values, scales and bf16 staging."""
        return int(sum(int(r.total().sum()) for r in self.reads.values())) + (self._quant.bytes if self._quant else 0)

    @property
    def destination_bytes(self) -> int:
        """Bytes of the parameters this rank holds (what a sync produces)."""
        return sum(t.numel() * t.element_size() for t in self._dst.values())

    @property
    def staging_bytes(self) -> int:
        """bf16 staging for the blocks this rank quantizes itself: the two slots of runtime/receiver/quant.py."""
        return self._quant.staging_bytes if self._quant else 0

    @property
    def descriptors(self) -> int:
        """READ descriptors posted per sync (small runs arrive packed, so fewer than the plan's runs)."""
        return sum(len(t) for t in self._tables.descriptors.values())

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
        start = time.monotonic()
        deadline = start + self.timeout
        synced, self._synced = self._synced, {}
        try:
            report = self._sync(version, start, deadline, previous, synced, into)
            self._held[into] = version
            return report
        except (SyncError, PlanMismatchError) as exc:
            self._hops.failed(version)
            for t in self._trainers.by_rank.values():
                self.agent.notify(t.peer.name, protocol.fail(version))
            if self.agent.stuck:
                self.agent.flush(0.1)  # the fail notifications go out to the trainers still reachable, before _renew_agent
            self._trainers.drop_all()
            self._hops.drop(version)
            raise type(exc)(f"inference rank {self.rank}: sync of version {version} failed; its weights are "
                            f"incomplete until a later sync succeeds: {exc}") from None

    def _sync(self, version: int, start: float, deadline: float, previous: int | None = None,
              synced: dict[int, str] | None = None, into: int = 0) -> SyncReport:
        self._hops.writing(version, deadline)  # before any byte of this version lands: peers are done with the last
        sources = sorted(self.reads)
        self.rendezvous.wait([protocol.version_key(r, version) for r in sources], deadline - time.monotonic(),
                             f"version {version} from trainer ranks {sources}")
        waited = time.monotonic()
        # The reading gets its own timeout: the trainers may have waited out their release timeout for a reader cut
        # off (once), and the readers still connected must not fail this version for it.
        deadline = waited + self.timeout
        incarnations = {r: self.rendezvous.get_text(protocol.version_key(r, version), protocol.INCARNATION) for r in sources}
        if self._may_be_given_up(version):
            self.rendezvous.put(protocol.returning_key(self.rank, version), self.incarnation.encode())
        self._renew_agent()  # here, once the store answered: a worker made while this node's link is down reaches nothing
        self._connect_all(version, incarnations, deadline)
        connected = time.monotonic()
        check, spent = self._verifier(version, deadline, into) if self.verify else (None, [0.0])
        try:
            self._check_sequence(version, deadline, "before reading")
        except PeerLost as exc:
            # NIXL found a connection broken while no sync ran (a link cut between syncs): connect again from the
            # published metadata, once, rather than fail this version too.
            log.info("inference rank %d: %s; connecting to trainer ranks %s again", self.rank, exc, sources)
            self._trainers.drop_all()
            self._renew_agent()
            self._connect_all(version, incarnations, deadline)
            connected = time.monotonic()
            self._check_sequence(version, deadline, "before reading")
        if self._quant and self._quant.begin():
            self.device_sync.wait("staging slots zeroed")  # before READs land in them
        took, delta_read, choices = self._delta_phase(version, previous, synced or {}, deadline)
        delta_bytes = sum(delta_read.values())
        self._ring_phase(version, deadline, took, into)
        self._transfer(version, start, deadline, self._post_ops(check), took, into)
        if self._quant:
            self._quant.end()
        self._check_sequence(version, deadline, "after reading")
        for t in self._trainers.by_rank.values():
            self.agent.notify(t.peer.name, protocol.ack(version))
        self._acked = version
        self._hops.landed(version)
        if self._hops.inbound:
            self._hops.receive(version, deadline)
            if check is not None:
                check("second hops")
            if self.post_op is not None:
                self.post_op(sorted(self.plan.dests[d].name for d in self._hops.entries))
        self._hops.settle(deadline)  # this node's peers read what this rank pulled for them
        self._derived()  # after the ack: it reads only this rank's memory, so the trainers need not wait
        self.device_sync.wait("derived state")
        self._version = version
        self._synced = {r: t.peer.incarnation for r, t in self._trainers.by_rank.items()}
        read = self.bytes - sum(t.deltable_bytes for r, t in self._trainers.by_rank.items() if r in took)
        seconds = time.monotonic() - start
        slowest = max(self._reading, key=self._reading.get, default=None)
        share = min(1.0, self._reading[slowest] / self._read_seconds) if slowest is not None and self._read_seconds > 0 else 0.0
        report = SyncReport(
            version=version, rank=self.rank, bytes=read + delta_bytes, descriptors=self.descriptors,
            trainer_ranks=len(sources), groups=self.n_groups, seconds=seconds,
            verify_seconds=spent[0] if self.verify else None,
            quantize_seconds=self._quant.seconds if self._quant else 0.0, derived_seconds=self._derived.seconds,
            table_bytes=self.table_bytes, packed_bytes=self.packed_read_bytes, second_hop_bytes=self._hops.bytes,
            second_hop_seconds=self._hops.seconds if self._hops.inbound else 0.0, slowest_trainer=slowest,
            slowest_share=share, took="full" if not took else "delta" if took == set(sources) else "mixed",
            delta_trainers=tuple(sorted(took)), delta_bytes=delta_bytes, delta_choices=choices,
            wait_seconds=waited - start, connect_seconds=connected - waited, paths=self._paths(took, delta_read))
        log.info("weightplan sync v%d inference rank %d (%s): %.3f GB, %d descriptors from %d trainer ranks, %.3f s, %.2f GB/s%s%s",
                 version, self.rank, report.took, report.bytes / 1e9, report.descriptors, report.trainer_ranks, report.seconds,
                 report.gbps, f", verified in {report.verify_seconds:.3f} s" if self.verify else "",
                 f", quantized in {report.quantize_seconds:.3f} s" if self._quant and self._quant.quantizes else "")
        if slowest is not None:
            log.info("weightplan sync v%d inference rank %d: slowest trainer rank %d, its READs outstanding for %.0f%% "
                     "of the read phase", version, self.rank, slowest, 100 * report.slowest_share)
        return report

    def _connect_all(self, version: int, incarnations: dict[int, str], deadline: float) -> None:
        """Connect to each trainer rank's incarnation (kept from an earlier sync when it is the same) and tell it this rank
        starts reading `version`.

        A trainer UCX cannot connect to is tried again, the first time with a new agent of this rank (a worker that
        cannot reach a live trainer, e.g. one made while this node's link was down, is replaced), then with that one
        (with another whenever this host's links changed since it was made),
        backing off up to 1 s, for CONNECT_PATIENCE_S or until `deadline`: the sync then fails naming that trainer,
        logged once per trainer incarnation, and the next sync tries again. A rank serving second hops keeps its agent
        (its node's peers hold its metadata): it tries once."""
        pause = CONNECT_RETRY_S
        deadline = min(deadline, time.monotonic() + CONNECT_PATIENCE_S)
        renewed = False
        while True:
            try:
                for r, incarnation in incarnations.items():
                    self._trainers.to(r, incarnation)
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
                    self._renew_agent()
                    renewed = True
        for t in self._trainers.by_rank.values():
            self.agent.notify(t.peer.name, protocol.begin(version))

    def _connect(self, rank: int, incarnation: str) -> _Trainer:
        """Prepare transfers to incarnation `incarnation` of trainer `rank`, once its info matches this rank's tables."""
        peer = Peer(self.agent, self.rendezvous, protocol.trainer(rank), incarnation)
        info = protocol.TrainerInfo.parse(peer.info, rank)
        regions = checked_regions(self.plan, self._qt, rank, info, incarnation)
        mismatch = info.options.mismatch(self._ring_bytes, self.verify)
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
        local = info.local if self.device_ipc == "auto" else None
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
        return _Trainer(
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
        self.agent.read_now([(seq, f"trainer rank {rank}")], time.monotonic() + self.timeout, "connecting over NIXL")
        return reader

    def _paths(self, took: set[int], delta_read: dict[int, int]) -> dict[str, int]:
        """The sync's `bytes` by path: each trainer's full bytes, or for one whose delta applied, the bytes a delta does
        not replace and its delta."""
        out: dict[str, int] = {}
        for rank, t in self._trainers.by_rank.items():
            parts = [t.paths]
            if rank in took:
                parts += [{k: -v for k, v in t.deltable_paths.items()}, {t.delta_path: delta_read.get(rank, 0)}]
            for part in parts:
                for path, n in part.items():
                    out[path] = out.get(path, 0) + n
        return {path: n for path, n in sorted(out.items()) if n}

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

    def _may_be_given_up(self, version: int) -> bool:
        """Whether the trainers may have stopped waiting for this rank before `version`: its last sync failed and its
        agent is to be renewed, or it did not ack the version before (it failed or skipped it, as an engine busy
        generating may). Such a rank says it is back (protocol.returning_key) before it connects, so that the trainers'
        release holds `version` open for it while it does."""
        stuck = self.agent.stuck and not self._hops.served  # a rank serving second hops keeps its agent (_renew_agent)
        return stuck or (self._acked is not None and self._acked != version - 1)

    def _check_sequence(self, version: int, deadline: float, when: str) -> None:
        def unstable(rank: int, seq: int) -> str:
            state = "is staging or retired it" if seq == 2 * version + 1 else f"holds version {seq // 2}"
            return f"trainer rank {rank} {when}: expected stable version {version}, the trainer {state}"

        check_sequence(self.reader, {rank: t.seq_read for rank, t in self._trainers.by_rank.items()}, self._seq, version,
                       deadline, f"reading trainer sequence words {when}", unstable)

    def _delta_phase(self, version: int, previous: int | None, synced: dict[int, str],
                     deadline: float) -> tuple[set[int], dict[int, int], tuple[DeltaChoice, ...]]:
        """Take `version` as a delta from every trainer rank whose delta applies to what this rank holds: its record names
        `previous` as base and this rank's current version came from that same trainer incarnation. Every delta is
        read and decoded before any is applied (a bad one fails the sync with nothing written). Returns the trainer
        ranks whose delta was applied, the bytes READ for each (indexes included) and the choices made; the others are
        read full, among them those whose delta was predicted slower than reading full (runtime/delta/rates.py)."""
        if self._delta is None or previous is None:
            return set(), {}, ()
        sources = {}
        for rank, t in self._trainers.by_rank.items():
            key = protocol.delta_key(rank, version)
            if t.delta is None or synced.get(rank) != t.peer.incarnation or not self.rendezvous.exists(key):
                continue
            record = protocol.parse_delta_record(self.rendezvous.get_json(key), rank, version)
            if record.base == previous:
                sources[rank] = (t.peer, t.delta, record)
        if not sources:
            return set(), {}, ()
        fetched = self._delta.fetch(self.reader, sources, version, deadline,
                                    {r: self._trainers.by_rank[r].deltable_bytes for r in sources})
        if fetched.too_large:
            log.info("inference rank %d: the deltas of version %d from trainer ranks %s exceed this rank's delta staging; "
                     "reading them full", self.rank, version, list(fetched.too_large))
        declined = [c.why for c in fetched.choices if not c.taken]
        if declined:
            log.info("inference rank %d: version %d read full where a delta is predicted slower: %s", self.rank, version,
                     "; ".join(declined))
        self._delta.apply(fetched.writes)
        return set(fetched.writes), fetched.by_rank, fetched.choices

    def _ring_phase(self, version: int, deadline: float, took: set[int] = frozenset(), into: int = 0) -> None:
        """READ every ring chunk this rank reads, from every trainer serving through a ring, as each becomes ready.

        A chunk is read once the trainer's ring word says it is stable for `version`, checked again after
        the READ (the trainer refills the ring only after this rank's `ring:v:c`, unless it gave up on
        it), then acknowledged. No wait blocks on one trainer, so rings of several trainers cannot deadlock.
        """
        pending = {rank: sorted(t.ring_reads[into]) for rank, t in self._trainers.by_rank.items()
                   if t.ring_reads[into] and rank not in took}
        backoff = Backoff()
        while pending:
            moved = False
            for rank in list(pending):
                t, chunk = self._trainers.by_rank[rank], pending[rank][0]
                what = f"trainer rank {rank}"
                if self._ring_state(t, version, chunk, deadline) != "ready":
                    continue
                self.reader.read_now([(h, what) for h in t.ring_reads[into][chunk]], deadline,
                                    f"version {version} ring chunk {chunk + 1} of {what}")
                if self._ring_state(t, version, chunk, deadline) != "ready":
                    raise SyncError(f"{what} refilled its ring while this rank read chunk {chunk + 1} of version {version}")
                self.agent.notify(t.peer.name, protocol.ring(version, chunk))
                pending[rank].pop(0)
                if not pending[rank]:
                    del pending[rank]
                moved = True
            if not moved:
                if time.monotonic() > deadline:
                    raise SyncError(f"version {version}: timed out waiting for ring chunks of trainer ranks {sorted(pending)}")
                backoff.sleep()

    def _ring_state(self, t: _Trainer, version: int, chunk: int, deadline: float) -> str:
        """'ready' when trainer `t`'s ring holds `chunk` of `version`, 'wait' before; SyncError once past it."""
        self.reader.read_now([(t.ring_word_read, f"trainer rank {t.rank}")], deadline, "reading a trainer's ring word")
        held, state = self._ring_word[t.rank].tolist()
        if held == version and state == 2 * chunk:
            return "ready"
        if held != version or state > 2 * chunk:
            raise SyncError(f"trainer rank {t.rank} moved its ring past chunk {chunk + 1} of version {version} "
                            f"(it holds version {held}): it gave up waiting for this rank")
        return "wait"

    def _transfer(self, version: int, start: float, deadline: float, post_op=None, took: set[int] = frozenset(),
                  into: int = 0) -> None:
        """Move every group; with a post-op, at most two groups are in flight and group g's post-op overlaps g+1.
        From the trainer ranks in `took` (their delta is applied) only the READs a delta does not replace move."""
        reads = {t.rank: t.full_only_reads if t.rank in took else t.group_reads[into] for t in self._trainers.by_rank.values()}
        window = 2 if post_op is not None else self.n_groups
        posted = 0
        shown = start
        posted_at = {}
        self._reading, self._read_seconds = {}, 0.0
        began = time.monotonic()
        for g in range(self.n_groups):
            while posted < min(self.n_groups, g + window):
                posted_at[posted] = time.monotonic()
                for t in self._trainers.by_rank.values():
                    for handle in reads[t.rank].get(posted, ()):
                        self.reader.post(handle, f"trainer rank {t.rank}")
                posted += 1
            handles = [(h, f"trainer rank {t.rank}") for t in self._trainers.by_rank.values() for h in reads[t.rank].get(g, ())]
            done_at = self.reader.wait(handles, deadline, f"version {version} group {g + 1}/{self.n_groups}")
            for t in self._trainers.by_rank.values():
                if reads[t.rank].get(g):
                    self._reading[t.rank] = self._reading.get(t.rank, 0.0) + done_at[f"trainer rank {t.rank}"] - posted_at[g]
            self._read_seconds = time.monotonic() - began
            if post_op is not None:
                post_op(g)
            if time.monotonic() - shown > PROGRESS_EVERY:
                shown = time.monotonic()
                log.info("weightplan sync v%d inference rank %d: group %d/%d done after %.1f s",
                         version, self.rank, g + 1, self.n_groups, shown - start)

    def _post_ops(self, check):
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

    def _verifier(self, version: int, deadline: float, into: int = 0):
        """A post-op comparing each group's landed bytes with the digests the trainers published for `version`;
        check("second hops") compares the entries read from pullers of this node (fan-out) with them too."""
        trainers = sorted(set(self._trainers.by_rank) | set(self._hop_reads))
        self.rendezvous.wait([protocol.digests_key(r, version) for r in trainers], deadline - time.monotonic(),
                             "trainer digests (start trainers with digests=True)")
        theirs = {r: self.rendezvous.get_json(protocol.digests_key(r, version)) for r in trainers}
        buffers = {d: byte_view(t) for d, t in self._dsts[into].items()}
        spent = [0.0]

        def check(group) -> None:
            began = time.perf_counter()
            bad = []
            hops = group == "second hops"
            for rank, reads in (self._hop_reads if hops else self.reads).items():
                part = reads if hops else reads.take(self._groups.groups[rank] == group)
                ours = {str(d): h for d, h in run_digests(buffers, part.dest, part.dst_byte, part.dst_stride, part).items()}
                if not hops and self._quant and rank in self._quant.rows:
                    ours.update(self._quant.digests(rank, group))
                bad += [f"{self._key_name(k)} (from trainer rank {rank})" for k, h in ours.items() if theirs[rank].get(k) != h]
            spent[0] += time.perf_counter() - began
            if bad:
                raise SyncError(f"verification failed for {len(bad)} regions, e.g. {', '.join(bad[:3])}")

        return check, spent

    def _key_name(self, key: str) -> str:
        return self.plan.dests[int(key)].name if key.isdigit() else self._quant.key_name(key)


def _addresses(plan: Plan, views: dict[int, torch.Tensor]) -> np.ndarray:
    """Each plan entry's address in one destination set (0 for entries this rank does not hold)."""
    addresses = np.zeros(len(plan.dests), dtype=np.int64)
    addresses[list(views)] = [t.data_ptr() for t in views.values()]
    return addresses
