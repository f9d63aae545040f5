"""What a Receiver reports: each completed sync (SyncReport, built from the sync's measures) and its fixed sizes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..delta.rates import DeltaChoice

log = logging.getLogger("weightplan.runtime")


@dataclass(frozen=True)
class ReceiverStats:
    """An inference rank's fixed sizes, known once its Receiver is built."""

    bytes: int  # READ per full sync: runs, plus with fp8 tables the fp8 values, scales and bf16 staging
    descriptors: int  # READ descriptors posted per sync (small runs arrive packed, so fewer than the plan's runs)
    # Every table this rank built, the trainers' packings it derived included: none has a row dimension (each alternate
    # destination set adds its own local addresses).
    table_bytes: int
    packed_read_bytes: int  # of `bytes`, those read from the trainers' packed regions of small runs
    constant_bytes: int  # of this rank's destinations, written by the plan's constants (never READ)
    destination_bytes: int  # of the parameters this rank holds (what a sync produces)
    staging_bytes: int  # bf16 staging for the blocks this rank quantizes itself: the two slots of runtime/receiver/quant.py


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

    @classmethod
    def build(cls, version: int, rank: int, stats: ReceiverStats, *, sources: list[int], groups: int,
              moments: tuple[float, float, float, float], took: set[int], deltable_bytes: int, delta_read: dict[int, int],
              choices: tuple[DeltaChoice, ...], paths: dict[str, int], reading: dict[int, float], read_seconds: float,
              verify_seconds: float | None, quantize_seconds: float, derived_seconds: float, second_hop_bytes: int,
              second_hop_seconds: float) -> "SyncReport":
        """The report of a sync of `version` from trainer ranks `sources`: `moments` are when it began, the trainers'
        version records were all there, this rank had connected, and it ended (time.monotonic()); `took` the trainer
        ranks whose delta applied, replacing `deltable_bytes` of the full READs by `delta_read` bytes from each;
        `reading` how long each trainer's grouped READs were outstanding within the `read_seconds` they took."""
        start, waited, connected, end = moments
        delta_bytes = sum(delta_read.values())
        slowest = max(reading, key=reading.get, default=None)
        share = min(1.0, reading[slowest] / read_seconds) if slowest is not None and read_seconds > 0 else 0.0
        return cls(
            version=version, rank=rank, bytes=stats.bytes - deltable_bytes + delta_bytes, descriptors=stats.descriptors,
            trainer_ranks=len(sources), groups=groups, seconds=end - start, verify_seconds=verify_seconds,
            quantize_seconds=quantize_seconds, derived_seconds=derived_seconds, table_bytes=stats.table_bytes,
            packed_bytes=stats.packed_read_bytes, second_hop_bytes=second_hop_bytes, second_hop_seconds=second_hop_seconds,
            slowest_trainer=slowest, slowest_share=share,
            took="full" if not took else "delta" if took == set(sources) else "mixed",
            delta_trainers=tuple(sorted(took)), delta_bytes=delta_bytes, delta_choices=choices,
            wait_seconds=waited - start, connect_seconds=connected - waited, paths=paths)

    def log(self, quantized: bool) -> None:
        """The sync's log lines (`quantized`: this rank quantized fp8 blocks itself)."""
        log.info("weightplan sync v%d inference rank %d (%s): %.3f GB, %d descriptors from %d trainer ranks, %.3f s, %.2f GB/s%s%s",
                 self.version, self.rank, self.took, self.bytes / 1e9, self.descriptors, self.trainer_ranks, self.seconds,
                 self.gbps, f", verified in {self.verify_seconds:.3f} s" if self.verify_seconds is not None else "",
                 f", quantized in {self.quantize_seconds:.3f} s" if quantized else "")
        if self.slowest_trainer is not None:
            log.info("weightplan sync v%d inference rank %d: slowest trainer rank %d, its READs outstanding for %.0f%% "
                     "of the read phase", self.version, self.rank, self.slowest_trainer, 100 * self.slowest_share)
