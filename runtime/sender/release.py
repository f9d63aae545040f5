"""A Sender's wait for its readers to finish one version: who acked, who failed, who is back, who it gives up on."""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum

from ..transport import protocol
from ..transport.protocol import Kind

# A reader given up on (its link was cut) that writes it is back for a version (protocol.returning_key) is waited for
# while it renews its NIXL agent and connects: its begin re-admits it and the release waits for its ack as for any
# reader. Without a begin within the grace the release goes on without it, so a reader that cannot connect costs the
# others at most this, once per return. RETURN_POLL_S: how often a release looks for such records (store round trips).
RETURN_GRACE_S = 3.0
RETURN_POLL_S = 0.05


@dataclass(frozen=True)
class ReleaseReport:
    """How version `version` ended on this trainer rank: who acknowledged it and who was given up on."""

    version: int
    acked: tuple[int, ...]
    failed: tuple[int, ...]
    timed_out: tuple[int, ...]
    seconds: float
    gatherers_timed_out: tuple[int, ...] = ()  # peer trainer ranks that had not finished their gather-side READs
    returned: tuple[int, ...] = ()  # inference ranks given up on earlier that said they read this version again
    left: tuple[int, ...] = ()  # inference ranks that left the job (protocol.left_key) since the last release: not waited for


class Stage(Enum):
    """Where a release stands."""

    WAITING = "waiting"  # for live readers' acks, gathering peers, or readers back from being given up on
    LOOKED_AGAIN = "looked again"  # nothing was left to wait for: it looked once more for readers that are back
    RELEASED = "released"  # nothing left to wait for: the version may be retired
    TIMED_OUT = "timed out"  # the deadline passed with someone still awaited


class ReleaseWait:
    """One `Sender.release(version)`: polls the sender's agent and the store until every live inference rank acked or
    failed `version`, every gathering peer gathered it, and every reader that wrote it is back (protocol.returning_key)
    began within RETURN_GRACE_S, or until `deadline`. `run()` returns its stage: RELEASED or TIMED_OUT. `sender`: the
    Sender releasing (runtime/sender/sender.py); `started`: when the release began (its report's seconds count from
    there)."""

    def __init__(self, sender, version: int, started: float, deadline: float):
        self.sender, self.version, self.started, self.deadline = sender, version, started, deadline
        self.stage = Stage.WAITING
        self.done: dict[int, Kind] = {}  # inference rank -> ACK or FAIL
        self.gathering = set(sender.gatherers)  # peer trainer ranks still READing this rank's bf16
        self.returning: dict[int, float] = {}  # given-up ranks back for this version -> until when their begin is awaited
        self.held: set[int] = set()  # of those, the ones still awaited
        self._next_look = self.started

    @property
    def waiting(self) -> set[int]:
        """Live inference ranks that neither acked nor failed `version`."""
        return self.sender._live - set(self.done)

    def run(self) -> Stage:
        while True:
            self._collect()
            now = time.monotonic()
            self._look_for_returns(now)
            self.sender._advance_ring(self.version, set(self.done), self.held)
            self.sender._forget_messages(self.version)
            self._drop_gathered()
            stage, self.stage = self.stage, self._next_stage(now)
            if self.stage in (Stage.RELEASED, Stage.TIMED_OUT):
                return self.stage
            if self.stage is stage:  # looking again goes round at once
                time.sleep(0.001)

    def _collect(self) -> None:
        """Record the acks and fails of `version` among the notifications received."""
        for rank, m in self.sender._collect_messages():
            if m.version == self.version and m.kind in (Kind.ACK, Kind.FAIL):
                self.done[rank] = m.kind

    def _look_for_returns(self, now: float) -> None:
        """Every RETURN_POLL_S while some reader is given up on: readers that wrote they are back get a grace."""
        given_up = self.sender._given_up
        if given_up and now >= self._next_look:
            self.returning.update({rank: min(self.deadline, now + RETURN_GRACE_S)
                                   for rank in self.sender._returning(self.version) if rank not in self.returning})
            self._next_look = now + RETURN_POLL_S
        self.held = {rank for rank, until in self.returning.items() if rank in given_up and now < until}

    def _drop_gathered(self) -> None:
        rendezvous = self.sender.rendezvous
        self.gathering -= {g for g in self.gathering if rendezvous.exists(protocol.gathered_key(g, self.version))}

    def _next_stage(self, now: float) -> Stage:
        """Nothing left to wait for: released, after one more look for returns when readers are given up on (a rank that
        said it is back since the last look is held for too). Else waiting, until the deadline."""
        if self.waiting or self.gathering or self.held:
            return Stage.TIMED_OUT if now > self.deadline else self.stage
        if self.stage is Stage.WAITING and self.sender._given_up and now <= self.deadline:
            self._next_look = now
            return Stage.LOOKED_AGAIN
        return Stage.RELEASED

    def report(self, timed_out: set[int], left: tuple[int, ...] = ()) -> ReleaseReport:
        """The report, `timed_out` the ranks given up on, `left` those that left before it began."""
        return ReleaseReport(self.version, tuple(sorted(k for k, s in self.done.items() if s is Kind.ACK)),
                             tuple(sorted(k for k, s in self.done.items() if s is Kind.FAIL)), tuple(sorted(timed_out)),
                             time.monotonic() - self.started, tuple(sorted(self.gathering)), tuple(sorted(self.returning)),
                             tuple(sorted(left)))
