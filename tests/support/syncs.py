"""Syncs of in-process Senders and Receivers on threads, ordered by the rendezvous store rather than by sleeps."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from weightplan.runtime.transport import protocol


def own_client(rendezvous):
    """A store client of its own per Sender and Receiver: a client blocked in wait() serves no other thread."""
    from weightplan.runtime import Rendezvous

    return Rendezvous.connect(rendezvous.job, rendezvous.address)


def publish_version(plan, senders, tensors, version: int) -> None:
    """The trainers' weights of `version` (runtime_worker.full_weights) copied into their registered tensors, then
    published by every Sender."""
    from weightplan.testing.runtime_worker import full_weights, shard

    full = full_weights(plan, 0, version)
    for sender in senders:
        for name, t in shard(plan, full, sender.rank).items():
            tensors[sender.rank][name].copy_(t)
        sender.publish(version)


def wait_for_key(rendezvous, key: str, seconds: float = 10.0) -> None:
    """Return once `key` exists in the store; fail the test after `seconds`."""
    deadline = time.monotonic() + seconds
    while not rendezvous.exists(key):
        assert time.monotonic() < deadline, f"{key} not written within {seconds} s"
        time.sleep(0.01)


def sync_while_released(senders, receivers, version: int, release_timeout: float = 5.0, returning=()):
    """Every receiver syncs `version` while every trainer releases it, each on its own thread (a ring packs chunk c + 1
    only inside release, once the readers of chunk c acknowledged it); returns the receivers' and the trainers' reports.

    A receiver in `returning` (one the trainers gave up on) starts first, and the trainers release once it wrote that
    it is back: a return announced only after the other readers acked comes too late, and that order is the test's
    to fix, not the host's speed. A failed sync raises its own SyncError."""
    with ThreadPoolExecutor(len(senders) + len(receivers)) as pool:
        synced = {r.rank: pool.submit(r.sync, version) for r in returning}
        for r in returning:
            wait_for_key(r.rendezvous, protocol.returning_key(r.rank, version))
        released = [pool.submit(s.release, version, release_timeout) for s in senders]
        synced.update({r.rank: pool.submit(r.sync, version) for r in receivers if r.rank not in synced})
        reports = [synced[r.rank].result() for r in receivers]
        return reports, [f.result() for f in released]
