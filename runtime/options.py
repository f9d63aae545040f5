"""The options both ends of a sync take (Sender and Receiver keywords): one typed record, one name per idea."""

from __future__ import annotations

from dataclasses import dataclass

from .tables.ring import DEFAULT_RING_BYTES
from .transport.progress import check_mode


@dataclass(frozen=True)
class SyncOptions:
    """`timeout`: seconds a Receiver waits for a version and then reads it, and a Sender's release waits for its readers.
    `verify`: a Sender publishes each version's digests, a Receiver compares every landed byte with them (both sides
    need it). `progress`: who progresses the NIXL agent (runtime/transport/progress.py); a Receiver progresses its
    agent while it syncs, so only "thread" changes it. `ring_bytes`: bound of a trainer's small-run region (the same on
    both sides). `delta`: the fraction of the served pages a delta holds (0: none). `fp8_path`, `delta_path`: where
    fp8 quantization and delta coding run ("auto", "device", ...; runtime/fp8/placement.py, runtime/delta/).
    `pool_ranks`: the inference ranks the trainers serve, beyond the plan's when its DP replicas can be copied (a
    Sender waits for those that joined; a Receiver's rank is below it; runtime/tables/ranks.py `check_pool`)."""

    timeout: float = 60.0
    verify: bool = False
    progress: str = "auto"
    ring_bytes: int = DEFAULT_RING_BYTES
    delta: float = 0.0
    fp8_path: str = "auto"
    delta_path: str = "auto"
    pool_ranks: int | None = None  # None: the plan's inference ranks

    def __post_init__(self) -> None:
        check_mode(self.progress)
