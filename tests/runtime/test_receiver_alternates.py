"""A Receiver with alternate destination sets (two NIXL agents, one process): syncs alternate between the sets, each
landing exactly the host executor's bytes of its version in the set it names, the other set untouched; every set is
registered and its READs prepared once; a failed sync leaves only its own set incomplete; bad alternates are refused
in one line."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from weightplan.runtime import PlanMismatchError, Receiver, Sender, SyncError, WeightplanError, load_plan

from weightplan.testing.runtime_worker import byte_equal, full_weights, host_reference, plain_destination, shard


@pytest.fixture
def bf16_plan(plan_cache):
    return load_plan(plan_cache("tiny-glm", "hf", "bf16", "fsdp=1", "tp=1"))


def _snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in tensors.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(byte_equal(a[name], b[name]) for name in a)


def _counting_prepares(agent) -> list:
    """Count the descriptor lists `agent` prepares from now on (an instance attribute over NixlAgent.prepare)."""
    calls = []
    prepare = agent.prepare

    def counted(*args, **kwargs):
        calls.append(args[0])
        return prepare(*args, **kwargs)

    agent.prepare = counted
    return calls


@pytest.mark.parametrize("ring_bytes", [512 << 20, 64 << 10])
def test_syncs_alternate_between_destination_sets(rendezvous, bf16_plan, ring_bytes):
    plan = bf16_plan
    versions = {v: full_weights(plan, 0, v) for v in (1, 2, 3)}
    tensors = {name: t.clone() for name, t in shard(plan, versions[1], 0).items()}
    sender = Sender(plan, 0, tensors, rendezvous=rendezvous, timeout=10, verify=True, progress="thread",
                    ring_bytes=ring_bytes).start()
    sets = [plain_destination(plan, 0), plain_destination(plan, 0)]
    receiver = Receiver(plan, 0, sets[0], alternates=[sets[1]], rendezvous=rendezvous, timeout=10, derived="caller",
                        verify=True, ring_bytes=ring_bytes).start()
    agent = receiver.agent
    try:
        if ring_bytes < 512 << 20:
            assert sender.ring is not None and len(sender.ring) > 1
        assert receiver.versions == (None, None)
        prepared = None
        for version, into in ((1, 0), (2, 1), (3, 0)):
            for name, t in shard(plan, versions[version], 0).items():
                tensors[name].copy_(t)
            other = _snapshot(sets[1 - into])
            sender.publish(version)
            with ThreadPoolExecutor(2) as pool:  # a ring packs its next chunk in release(), once this rank acked
                released = pool.submit(sender.release, version)
                report = receiver.sync(version, into=into)
                assert released.result().acked == (0,)
            assert report.verify_seconds is not None and report.bytes == sum(e.nbytes for e in plan.dests)
            assert _same(sets[into], host_reference(plan, versions[version], 0)), f"set {into} != version {version}"
            assert _same(sets[1 - into], other), f"set {1 - into} changed by a sync into set {into}"
            assert receiver.version == version
            if prepared is None:  # after the first sync: every set's READs from this trainer are prepared
                prepared = _counting_prepares(agent)
        assert receiver.versions == (3, 2)
        assert receiver.agent is agent and prepared == [], "a later sync prepared descriptor lists again"
    finally:
        receiver.close()
        sender.close()


def test_a_failed_sync_leaves_only_its_set_incomplete(rendezvous, bf16_plan):
    plan = bf16_plan
    sender = Sender(plan, 0, shard(plan, full_weights(plan, 0, 1), 0), rendezvous=rendezvous, timeout=10, verify=True,
                    progress="thread").start()
    sets = [plain_destination(plan, 0), plain_destination(plan, 0)]
    receiver = Receiver(plan, 0, sets[0], alternates=[sets[1]], rendezvous=rendezvous, timeout=10, derived="caller",
                        verify=True).start()
    try:
        sender.publish(1)
        receiver.sync(1, into=0)
        sender.release(1, timeout=5)
        first = _snapshot(sets[0])
        sender.publish(2)
        sender._packed[0] ^= 0xFF  # corrupted after publish: set 1 gets bytes that fail verification
        with pytest.raises(SyncError, match="sync of version 2 failed.*verification failed"):
            receiver.sync(2, into=1)
        assert receiver.version is None and receiver.versions == (1, None)
        assert _same(sets[0], first)
        sender._packed[0] ^= 0xFF
        sender.publish(3)
        receiver.sync(3, into=1)  # the same set again, after the failure: whole
        assert receiver.versions == (1, 3)
        assert _same(sets[1], host_reference(plan, full_weights(plan, 0, 1), 0))  # the tensors never changed
    finally:
        receiver.close()
        sender.close()


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_bad_alternates_are_refused_in_one_line(rendezvous, bf16_plan, no_agents):
    plan = bf16_plan
    destination = plain_destination(plan, 0)
    name = max(destination, key=lambda n: destination[n].numel())
    t = destination[name]

    def receiver(alternate, **kwargs):
        return Receiver(plan, 0, destination, alternates=[alternate], rendezvous=rendezvous, derived="caller", **kwargs)

    cases = [
        ({k: v for k, v in plain_destination(plan, 0).items() if k != name}, f"alternate destination 1 tensors missing: {name}"),
        ({**plain_destination(plan, 0), name: torch.zeros(t.numel() + 1, dtype=t.dtype)}, "alternate destination 1 tensor"),
        ({**plain_destination(plan, 0), name: torch.zeros(t.shape, dtype=torch.float16)},
         f"is float16.*the plan expects {str(t.dtype).removeprefix('torch.')}"),
        ({**plain_destination(plan, 0), name: torch.zeros((*t.shape, 2), dtype=t.dtype)[..., 0]}, "is not contiguous"),
        ({**plain_destination(plan, 0), name: t}, "share memory"),  # the destination's own tensor
        ({**plain_destination(plan, 0), "not.in.plan": t}, "not in the plan: not.in.plan"),
    ]
    for alternate, match in cases:
        with pytest.raises(PlanMismatchError, match=match) as excinfo:
            receiver(alternate)
        _one_line(excinfo)
    with pytest.raises(PlanMismatchError, match="alternate destinations are refused with delta") as excinfo:
        receiver(plain_destination(plan, 0), delta=0.5)
    _one_line(excinfo)


def test_a_set_that_does_not_exist_is_refused(rendezvous, bf16_plan):
    plan = bf16_plan
    receiver = Receiver(plan, 0, plain_destination(plan, 0), alternates=[plain_destination(plan, 0)],
                        rendezvous=rendezvous, derived="caller")
    for into in (2, -1, True):
        with pytest.raises(WeightplanError, match="destination set .* does not exist: this Receiver has 2") as excinfo:
            receiver.sync(1, into=into)
        _one_line(excinfo)
    with pytest.raises(WeightplanError, match="does not exist"):
        receiver.write_constants(into=2)
