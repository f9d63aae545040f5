"""The READ phases of one sync: each trainer's ring chunks as its ring holds them, then the pipelined groups."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..errors import SyncError
from ..transport import protocol
from ..transport.nixl_agent import Backoff
from .connections import Trainer, TrainerConnections

log = logging.getLogger("weightplan.runtime")
PROGRESS_EVERY = 5.0  # seconds between progress lines of a long sync


@dataclass
class GroupTimes:
    """How long each trainer rank's grouped READs were outstanding (summed over groups, from posting to done) and the
    grouped READs' phase, wall time: the straggler report of SyncReport."""

    reading: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0


def read_ring_chunks(links: TrainerConnections, version: int, deadline: float, took: set[int] = frozenset(),
                     into: int = 0) -> None:
    """READ every ring chunk this rank reads, from every trainer serving through a ring (not in `took`, whose delta
    applied), as each becomes ready.

    A chunk is read once the trainer's ring word says it is stable for `version`, checked again after
    the READ (the trainer refills the ring only after this rank's `ring:v:c`, unless it gave up on
    it), then acknowledged. No wait blocks on one trainer, so rings of several trainers cannot deadlock.
    """
    trainers = links.trainers.by_rank
    pending = {rank: sorted(t.ring_reads[into]) for rank, t in trainers.items() if t.ring_reads[into] and rank not in took}
    backoff = Backoff()
    while pending:
        moved = False
        for rank in list(pending):
            t, chunk = trainers[rank], pending[rank][0]
            what = f"trainer rank {rank}"
            if _ring_state(links, t, version, chunk, deadline) != "ready":
                continue
            links.reader.read_now([(h, what) for h in t.ring_reads[into][chunk]], deadline,
                                  f"version {version} ring chunk {chunk + 1} of {what}")
            if _ring_state(links, t, version, chunk, deadline) != "ready":
                raise SyncError(f"{what} refilled its ring while this rank read chunk {chunk + 1} of version {version}")
            links.agent.notify(t.peer.name, protocol.ring(version, chunk))
            pending[rank].pop(0)
            if not pending[rank]:
                del pending[rank]
            moved = True
        if not moved:
            if time.monotonic() > deadline:
                raise SyncError(f"version {version}: timed out waiting for ring chunks of trainer ranks {sorted(pending)}")
            backoff.sleep()


def _ring_state(links: TrainerConnections, t: Trainer, version: int, chunk: int, deadline: float) -> str:
    """'ready' when trainer `t`'s ring holds `chunk` of `version`, 'wait' before; SyncError once past it."""
    links.reader.read_now([(t.ring_word_read, f"trainer rank {t.rank}")], deadline, "reading a trainer's ring word")
    held, state = links.ring_word[t.rank].tolist()
    if held == version and state == 2 * chunk:
        return "ready"
    if held != version or state > 2 * chunk:
        raise SyncError(f"trainer rank {t.rank} moved its ring past chunk {chunk + 1} of version {version} "
                        f"(it holds version {held}): it gave up waiting for this rank")
    return "wait"


def read_groups(links: TrainerConnections, n_groups: int, version: int, start: float, deadline: float, post_op=None,
                took: set[int] = frozenset(), into: int = 0) -> GroupTimes:
    """Move every group; with a post-op, at most two groups are in flight and group g's post-op overlaps g+1.
    From the trainer ranks in `took` (their delta is applied) only the READs a delta does not replace move."""
    trainers = links.trainers.by_rank.values()
    reads = {t.rank: t.full_only_reads if t.rank in took else t.group_reads[into] for t in trainers}
    window = 2 if post_op is not None else n_groups
    posted = 0
    shown = start
    posted_at = {}
    times = GroupTimes()
    began = time.monotonic()
    for g in range(n_groups):
        while posted < min(n_groups, g + window):
            posted_at[posted] = time.monotonic()
            for t in trainers:
                for handle in reads[t.rank].get(posted, ()):
                    links.reader.post(handle, f"trainer rank {t.rank}")
            posted += 1
        handles = [(h, f"trainer rank {t.rank}") for t in trainers for h in reads[t.rank].get(g, ())]
        done_at = links.reader.wait(handles, deadline, f"version {version} group {g + 1}/{n_groups}")
        for t in trainers:
            if reads[t.rank].get(g):
                times.reading[t.rank] = times.reading.get(t.rank, 0.0) + done_at[f"trainer rank {t.rank}"] - posted_at[g]
        times.seconds = time.monotonic() - began
        if post_op is not None:
            post_op(g)
        if time.monotonic() - shown > PROGRESS_EVERY:
            shown = time.monotonic()
            log.info("weightplan sync v%d inference rank %d: group %d/%d done after %.1f s",
                     version, links.rank, g + 1, n_groups, shown - start)
    return times
