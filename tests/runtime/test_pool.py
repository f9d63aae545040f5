"""The inference pool grows and shrinks by DP replicas beyond the plan's ranks (Sender/Receiver `pool_ranks`)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightplan.runtime import PlanMismatchError, Receiver, Sender, load_plan
from weightplan.runtime.plan.header import RankCoords
from weightplan.runtime.tables.ranks import held_entries, layout_rank, pool_members
from weightplan.runtime.transport import protocol
from weightplan.testing.runtime_worker import byte_equal, full_weights, host_reference, plain_destination, shard

from ..support.syncs import own_client, publish_version, sync_while_released

TIMEOUT = 20.0  # of every sync and release here: a loaded 2-core host must not fail them
POOL = 4  # the plan's 2 DP replicas and 2 more; rank 3 never joins

LLAMA = ("tiny-llama", "hf", "bf16", "fsdp=2")


@pytest.fixture
def dp2(plan_cache):
    return load_plan(plan_cache(*LLAMA, "dp=2"))



def _receiver(plan, rank: int, rendezvous, pool_ranks=POOL) -> tuple[Receiver, dict]:
    destination = plain_destination(plan, layout_rank(plan, rank, pool_ranks))
    receiver = Receiver(plan, rank, destination, rendezvous=own_client(rendezvous), timeout=TIMEOUT, derived="caller",
                        pool_ranks=pool_ranks).start()
    return receiver, destination



def _assert_host_bytes(plan, destinations: dict[int, dict], version: int) -> None:
    """Each rank's destination holds what the host executor writes into the plan rank it copies."""
    full = full_weights(plan, 0, version)
    for rank, destination in destinations.items():
        expected = host_reference(plan, full, layout_rank(plan, rank, POOL))
        differ = [n for n, t in expected.items() if not byte_equal(t, destination[n])]
        assert expected and not differ, (rank, differ[:3])


def test_a_replica_beyond_the_plan_joins_syncs_leaves_and_returns(rendezvous, dp2):
    """Version 2: a third replica (inference rank 2 of a pool of 4) joins, syncs byte for byte what plan rank 0 holds,
    and the trainers wait for it. Version 3: rank 1 left (close), and the release does not wait for it. Version 4: a new
    process of rank 1 joins again and syncs. Rank 3 never joins and is never waited for."""
    tensors = {r: shard(dp2, full_weights(dp2, 0, 1), r) for r in range(dp2.header.src_ranks)}
    senders = [Sender(dp2, r, tensors[r], rendezvous=own_client(rendezvous), timeout=TIMEOUT, progress="thread",
                      pool_ranks=POOL).start() for r in range(dp2.header.src_ranks)]
    assert all(s.readers == (0, 1, 2, 3) for s in senders)
    readers = {k: _receiver(dp2, k, rendezvous) for k in (0, 1)}

    def sync(version: int):
        publish_version(dp2, senders, tensors, version)
        reports, released = sync_while_released(senders, [r for r, _ in readers.values()], version, TIMEOUT)
        assert [r.version for r in reports] == [version] * len(readers)
        _assert_host_bytes(dp2, {k: d for k, (_, d) in readers.items()}, version)
        return reports, released

    for report in sync(1)[1]:
        assert report.acked == (0, 1) and report.timed_out == (), report

    readers[2] = _receiver(dp2, 2, rendezvous)  # the pool grows at version 2
    assert readers[2][0].plan_rank == 0 and readers[2][0].agent.name == f"{rendezvous.job}.inference.2"
    reports, released = sync(2)
    assert [r.rank for r in reports] == [0, 1, 2] and reports[2].bytes == reports[0].bytes
    for report in released:
        assert report.acked == (0, 1, 2) and report.timed_out == (), report

    gone, _ = readers.pop(1)
    gone.close()  # the pool shrinks: the trainers learn it at their next release
    assert rendezvous.get_json(protocol.left_key(1)) == {"incarnation": gone.incarnation}
    for report in sync(3)[1]:
        assert report.acked == (0, 2) and report.left == (1,) and report.timed_out == (), report
        assert report.seconds < TIMEOUT / 4, report

    readers[1] = _receiver(dp2, 1, rendezvous)  # a new process of rank 1: another incarnation
    for report in sync(4)[1]:
        assert report.acked == (0, 1, 2) and report.left == () and report.timed_out == (), report
    for receiver, _ in readers.values():
        receiver.close()
    for sender in senders:
        sender.close()


def test_a_pool_rank_the_trainers_do_not_count_is_refused_at_connect(rendezvous, dp2):
    """Trainers without `pool_ranks` never wait for rank 2: its sync is refused in one line, nothing read."""
    tensors = {r: shard(dp2, full_weights(dp2, 0, 1), r) for r in range(dp2.header.src_ranks)}
    senders = [Sender(dp2, r, tensors[r], rendezvous=own_client(rendezvous), timeout=TIMEOUT, progress="thread").start()
               for r in range(dp2.header.src_ranks)]
    receiver, _ = _receiver(dp2, 2, rendezvous)
    for sender in senders:
        sender.publish(1)
    with pytest.raises(PlanMismatchError, match="pool_ranks is 2 there and this is inference rank 2") as caught:
        receiver.sync(1)
    assert "\n" not in str(caught.value) and receiver.version is None
    receiver.close()
    for sender in senders:
        sender.close()


@pytest.mark.parametrize("inference,rank,pool,message", [
    ("dp=2", 4, 4, r"inference rank 4 is not in the pool's 4 inference ranks \(0\.\.3, pool_ranks\)"),
    ("dp=2", 0, 1, "pool_ranks must be an int of at least the plan's 2 inference ranks, not 1"),
    ("tp=2,dp=2", 4, 5, r"pool_ranks=5 is not whole replicas of the plan's 2 ranks \(tp=2 x pp=1\)"),
    ("dp=2,gpus-per-node=2", 2, 4, "pool_ranks=4: this plan has node-local fan-out"),
])
def test_bad_pools_are_refused_in_one_line_before_anything_starts(no_agents, rendezvous, plan_cache, inference, rank,
                                                                  pool, message):
    plan = load_plan(plan_cache(*LLAMA, inference))
    _assert_refused(plan, rank, pool, message, rendezvous)


def test_an_expert_parallel_plan_has_no_pool(no_agents, rendezvous, plan_cache):
    plan = load_plan(plan_cache("tiny-qwen3-moe", "hf", "bf16", "fsdp=1", "dp=2,ep"))
    _assert_refused(plan, 2, 4, "pool_ranks=4: expert parallel plans give each DP rank its own experts: a replica beyond "
                                "the plan's 2 ranks needs a plan compiled for the new size", rendezvous)


def _assert_refused(plan, rank: int, pool: int, message: str, rendezvous) -> None:
    """Receiver `rank` of a pool of `pool` is refused with `message` in one line, and so is a Sender of that pool when the
    plan cannot have it; no agent is made (`no_agents`) and nothing is written."""
    destination = plain_destination(plan, rank % plan.header.dst_ranks)
    with pytest.raises(PlanMismatchError, match=message) as caught:
        Receiver(plan, rank, destination, rendezvous=rendezvous, derived="caller", pool_ranks=pool)
    assert "\n" not in str(caught.value)
    if "inference rank" not in message:  # a pool the plan cannot have: the trainers refuse it too
        tensors = shard(plan, full_weights(plan, 0, 1), 0)
        with pytest.raises(PlanMismatchError, match=message):
            Sender(plan, 0, tensors, rendezvous=rendezvous, pool_ranks=pool)
    assert not rendezvous.exists(protocol.joined_key(rank)) and not rendezvous.exists("trainer/0/info")


def test_replicas_holding_different_entries_are_refused_naming_the_first(dp2):
    first = dp2.dests[0]
    lopsided = dataclasses.replace(dp2, header=dataclasses.replace(
        dp2.header, dests=(dataclasses.replace(first, ranks=(0,)), *dp2.dests[1:])))
    with pytest.raises(PlanMismatchError, match=f"DP replicas do not hold identical entries \\({first.name!r} is on "
                                                r"inference ranks \[0\] only\)"):
        layout_rank(lopsided, 2, POOL)
    assert layout_rank(lopsided, 1) == 1  # without a pool nothing is asked of the replicas


@pytest.fixture(scope="module")
def compiled(plan_cache):
    return [load_plan(plan_cache(*LLAMA, inference)) for inference in ("dp=2", "tp=2,dp=2", "tp=2,pp=3,dp=2")]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_pool_rank_holds_what_the_plan_ranks_at_its_place_hold(compiled, data):
    """Over compiled tp/pp/dp plans: a pool rank's layout rank holds the very entries every plan rank at the same TP and
    pipeline place holds (held_entries), and pool_members inverts the mapping."""
    plan = data.draw(st.sampled_from(compiled))
    h = plan.header.inference
    width = h.tp * (h.pp or 1)
    pool = plan.header.dst_ranks + width * data.draw(st.integers(0, 3))
    rank = data.draw(st.integers(0, pool - 1))
    plan_rank = layout_rank(plan, rank, pool)
    if rank < plan.header.dst_ranks:
        assert plan_rank == rank
    held = held_entries(plan, plan_rank)
    for replica in range(h.dp):
        same_place = dataclasses.replace(RankCoords.of(rank, h.tp, h.pp or 1), dp=replica).rank(h.tp, h.pp or 1)
        assert np.array_equal(held_entries(plan, same_place), held)
    assert rank in pool_members(plan, {plan_rank}, pool)


@settings(max_examples=200, deadline=None)
@given(tp=st.integers(1, 8), pp=st.integers(1, 4), dp=st.integers(1, 6), extra=st.integers(0, 5), data=st.data())
def test_layout_rank_keeps_the_tp_and_pipeline_place(tp, pp, dp, extra, data):
    """The arithmetic alone, on plans whose entries every DP replica holds alike: a rank of the pool maps to the plan
    rank of DP replica 0 with its TP and pipeline coordinates, and every plan rank to itself."""
    ranks, width = tp * pp * dp, tp * pp
    plan = SimpleNamespace(
        header=SimpleNamespace(dst_ranks=ranks, inference=SimpleNamespace(tp=tp, pp=pp if pp > 1 else None, dp=dp, ep=False)),
        fanout=None, staging=(),
        dests=tuple(SimpleNamespace(name=f"e{p}", ranks=tuple(p + r for r in range(0, ranks, width))) for p in range(width)))
    pool = ranks + width * extra
    rank = data.draw(st.integers(0, pool - 1))
    plan_rank = layout_rank(plan, rank, pool)
    place = RankCoords.of(rank, tp, pp)
    assert plan_rank == (rank if rank < ranks else RankCoords(place.tp, place.pp, 0).rank(tp, pp))
    assert RankCoords.of(plan_rank, tp, pp).tp == place.tp and RankCoords.of(plan_rank, tp, pp).pp == place.pp
