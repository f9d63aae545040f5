"""An expert-parallel resize of the inference pool: trainers and engines switch to another size's plan at one version."""

from __future__ import annotations

import pytest

from weightplan.runtime import PlanMismatchError, Receiver, Sender, SyncError, load_plan
from weightplan.runtime.transport import protocol
from weightplan.testing.runtime_worker import byte_equal, full_weights, host_reference, plain_destination, shard

from ..support.syncs import own_client, publish_version, sync_while_released

TIMEOUT = 20.0  # of every sync here: a loaded 2-core host must not fail them
RELEASE = 8.0  # of every release: a release that waited for a reader of the old plan would show as timed_out
MOE = ("tiny-qwen3-moe", "stacked", "bf16", "fsdp=2")
SWITCH = 3  # the first version under the new size's plan


@pytest.fixture
def sizes(plan_cache):
    """The plans compiled ahead for the listed inference sizes: 2 and 4 expert-parallel DP ranks."""
    return {size: load_plan(plan_cache(*MOE, f"dp={size},ep")) for size in (2, 4)}



def _receiver(plan, rank: int, rendezvous) -> tuple[Receiver, dict]:
    destination = plain_destination(plan, rank)
    receiver = Receiver(plan, rank, destination, rendezvous=own_client(rendezvous), timeout=TIMEOUT,
                        derived="caller").start()
    return receiver, destination


def _senders(plan, tensors, rendezvous) -> list[Sender]:
    return [Sender(plan, r, tensors[r], rendezvous=own_client(rendezvous), timeout=TIMEOUT, progress="thread").start()
            for r in range(plan.header.src_ranks)]



def _read(plan, senders, readers: dict, version: int):
    """Every reader syncs the published `version` while the trainers release it; each reader's bytes are the host
    executor's. Returns the trainers' release reports."""
    reports, released = sync_while_released(senders, [r for r, _ in readers.values()], version, RELEASE)
    assert [r.version for r in reports] == [version] * len(readers)
    full = full_weights(plan, 0, version)
    for rank, (_, destination) in readers.items():
        expected = host_reference(plan, full, rank)
        differ = [n for n, t in expected.items() if not byte_equal(t, destination[n])]
        assert expected and not differ, (rank, differ[:3])
    return released


def _sync(plan, senders, tensors, readers: dict, version: int):
    publish_version(plan, senders, tensors, version)
    return _read(plan, senders, readers, version)


def _switch(senders, plan, tensors, rendezvous) -> list[Sender]:
    """Each trainer rank closes its Sender of the old plan and starts one of `plan`, same process, same tensors."""
    for sender in senders:
        sender.close()
    return _senders(plan, tensors, rendezvous)


def test_the_pool_grows_from_two_to_four_expert_parallel_ranks_at_one_version(rendezvous, sizes):
    """v1-v2 on dp=2,ep (2 readers); at v3 the trainers switch to the dp=4,ep plan and 4 readers of it sync v3 and v4
    byte for byte what the host executor writes, never waiting for the old readers (still running); an old reader asking
    v3 fails in one line naming the new plan; a trainer resumed below the switch is refused in one line."""
    old, new = sizes[2], sizes[4]
    assert old.header.src_ranks == new.header.src_ranks == 2 and old.fingerprint != new.fingerprint
    tensors = {r: shard(old, full_weights(old, 0, 1), r) for r in range(old.header.src_ranks)}
    senders = _senders(old, tensors, rendezvous)
    before = {k: _receiver(old, k, rendezvous) for k in range(2)}
    for version in (1, 2):
        for report in _sync(old, senders, tensors, before, version):
            assert report.acked == (0, 1) and report.timed_out == (), report

    senders = _switch(senders, new, tensors, rendezvous)
    after = {k: _receiver(new, k, rendezvous) for k in range(4)}  # the new size's engines join; the old ones still run
    publish_version(new, senders, tensors, SWITCH)
    stale, destination = before[0]
    kept = {n: t.clone() for n, t in destination.items()}
    with pytest.raises(PlanMismatchError) as caught:  # while v3 is live under the new plan
        stale.sync(SWITCH)
    assert str(caught.value) == (
        f"inference rank 0: sync of version {SWITCH} failed; its weights are incomplete until a later sync succeeds: "
        f"trainer rank 0 runs plan {new.fingerprint[:12]}, this rank runs {old.fingerprint[:12]}: both sides must load "
        "the same plan file")
    assert stale.version is None and all(byte_equal(kept[n], destination[n]) for n in kept)  # not a byte of v3 read
    for version in (SWITCH, SWITCH + 1):
        if version > SWITCH:
            publish_version(new, senders, tensors, version)
        for report in _read(new, senders, after, version):
            assert report.acked == (0, 1, 2, 3) and report.failed == report.timed_out == report.left == (), report
            assert report.seconds < RELEASE / 2, report

    resumed = Sender(new, 0, tensors[0], rendezvous=own_client(rendezvous), timeout=TIMEOUT).start()
    with pytest.raises(SyncError) as caught:  # a trainer rank resumed from a checkpoint of before the switch
        resumed.publish(SWITCH - 1)
    assert str(caught.value) == (
        f"trainer rank 0: version {SWITCH - 1} is not after version {SWITCH + 1}, which an earlier process of this rank "
        f"published in job {rendezvous.job!r}: a restarted trainer resumes its version counter from its checkpoint and "
        "publishes a later version (a new run takes a new job id); nothing published")
    assert rendezvous.get_json(protocol.published_key(0)) == protocol.published_record(SWITCH + 1, senders[0].incarnation)
    resumed.close()
    for receiver, _ in [*before.values(), *after.values()]:
        receiver.close()
    for sender in senders:
        sender.close()


def test_readers_of_the_old_plan_still_running_never_hold_a_release_of_the_new_one(rendezvous, sizes):
    """The grown pool's new ranks 2 and 3 join first; ranks 0 and 1 still run the old plan (joined, never closed) while
    the trainers release v3 under the new plan: the release waits for ranks 2 and 3 only. Ranks 0 and 1 then come back
    as engines of the new size and sync v4 with the rest; the old processes' close disturbs nothing."""
    old, new = sizes[2], sizes[4]
    tensors = {r: shard(old, full_weights(old, 0, 1), r) for r in range(old.header.src_ranks)}
    senders = _senders(old, tensors, rendezvous)
    before = {k: _receiver(old, k, rendezvous) for k in range(2)}
    for report in _sync(old, senders, tensors, before, SWITCH - 1):
        assert report.acked == (0, 1), report

    senders = _switch(senders, new, tensors, rendezvous)
    after = {k: _receiver(new, k, rendezvous) for k in (2, 3)}
    for report in _sync(new, senders, tensors, after, SWITCH):
        assert report.acked == (2, 3) and report.timed_out == () and report.seconds < RELEASE / 2, report

    for receiver, _ in before.values():
        receiver.close()
    after.update({k: _receiver(new, k, rendezvous) for k in (0, 1)})
    for report in _sync(new, senders, tensors, dict(sorted(after.items())), SWITCH + 1):
        assert report.acked == (0, 1, 2, 3) and report.timed_out == () and report.left == (), report
    for receiver, _ in after.values():
        receiver.close()
    for sender in senders:
        sender.close()


def test_a_joined_record_names_its_plan_and_a_bad_one_is_one_line(rendezvous):
    """What a trainer reads of a join (protocol.joined_plan): the incarnation and plan fingerprint, None for the plan of
    a record written without one (an older receiver: waited for as before); a malformed plan is one SyncError line."""
    incarnation, plan = "a" * 32, "b" * 64
    assert protocol.joined_plan(rendezvous, 0) is None
    rendezvous.put(protocol.joined_key(0), protocol.joined_record(incarnation, "job.inference.0", plan))
    assert protocol.joined_plan(rendezvous, 0) == (incarnation, plan)
    rendezvous.put(protocol.joined_key(1), {"incarnation": incarnation, "agent": "job.inference.1"})
    assert protocol.joined_plan(rendezvous, 1) == (incarnation, None)
    rendezvous.put(protocol.joined_key(2), {"incarnation": incarnation, "agent": "job.inference.2", "plan": "x" * 80})
    with pytest.raises(SyncError, match=r"^inference rank 2: its joined record's plan is x{40}, not a plan fingerprint$"):
        protocol.joined_plan(rendezvous, 2)
