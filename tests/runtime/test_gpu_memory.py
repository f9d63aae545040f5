"""GPU memory without a GPU: memory types from the tensors (mixed on one rank), NIXL lists per placement, and the
ordering hooks (a fake stream records when the runtime waits for device work)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weightplan.runtime import Receiver, Sender, SyncError, WeightplanError, load_plan
from weightplan.runtime.device import DeviceSync, cuda_devices
from weightplan.runtime.transport import nixl_agent, protocol
from weightplan.runtime.transport.memory import DRAM, HOST, VRAM, MemoryMap, Placement, Span, placement_of

from weightplan.testing.runtime_worker import byte_equal, full_weights, host_reference, plain_destination, shard

from ..support.fake_nixl import FakeNixl, on_cuda


@pytest.fixture
def fake_agent(monkeypatch):
    monkeypatch.setattr(nixl_agent, "_nixl", lambda: (FakeNixl, lambda **kwargs: None))
    return nixl_agent.NixlAgent("job.inference.0")


def test_placement_follows_the_tensor():
    assert placement_of(torch.zeros(2)) == HOST == Placement(DRAM, 0)
    assert placement_of(on_cuda(torch.zeros(2), 3)) == Placement(VRAM, 3)
    with pytest.raises(WeightplanError, match="on meta cannot be registered") as err:
        placement_of(torch.zeros(2, device="meta"))
    assert "\n" not in str(err.value)
    assert cuda_devices([torch.zeros(1), on_cuda(torch.zeros(1), 1), None, on_cuda(torch.zeros(1), 0)]) == (
        torch.device("cuda", 0), torch.device("cuda", 1))


def test_one_rank_registers_host_words_and_device_weights_apart(fake_agent):
    """A receiver on a GPU: parameters on cuda:1, fp8 staging on cuda:1, sequence and ring words in host memory."""
    weights = [on_cuda(torch.zeros(64), 1), on_cuda(torch.zeros(8, 8), 1)]
    words = [torch.zeros(2, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)]
    fake_agent.register([weights[0], words[0], weights[1], words[1], torch.zeros(0)])
    kinds = [(kind, [row[2] for row in rows]) for kind, rows in fake_agent._agent.registered]
    assert kinds == [(VRAM, [1, 1]), (DRAM, [0, 0])]
    published = fake_agent.memory.record()
    assert sorted((r[2], r[3]) for r in published) == [(DRAM, 0)] * 2 + [(VRAM, 1)] * 2
    assert MemoryMap.from_record(published, "x").spans() == fake_agent.memory.spans()


def test_a_list_spanning_host_and_device_is_one_nixl_list_per_placement_and_reads_pair_them(fake_agent):
    device, host = on_cuda(torch.zeros(32), 0), torch.zeros(32)
    fake_agent.register([device, host])
    d, h = device.data_ptr(), host.data_ptr()
    local = fake_agent.prepare(None, np.array([[d, 16], [h, 16], [d + 16, 16], [h + 64, 64]]))
    lists = fake_agent._agent.lists
    assert [(kind, rows) for _, kind, rows in lists] == [(DRAM, [[h, 16, 0], [h + 64, 64, 0]]),
                                                         (VRAM, [[d, 16, 0], [d + 16, 16, 0]])]
    assert [r for r in local.rows.group.tolist()] == [1, 0, 1, 0] and local.rows.index.tolist() == [0, 0, 1, 1]
    peer_memory = MemoryMap.of([Span(1 << 40, 1 << 20, Placement(VRAM, 2)), Span(1 << 41, 4096, HOST)])
    remote = fake_agent.prepare("job.trainer.0", np.array([[1 << 40, 16], [1 << 41, 16], [1 << 41, 16], [(1 << 40) + 64, 64]]),
                                peer_memory)
    assert [(agent, kind, [r[2] for r in rows]) for agent, kind, rows in lists[2:]] == [
        ("job.trainer.0", DRAM, [0, 0]), ("job.trainer.0", VRAM, [2, 2])]
    read = fake_agent.make_read(local, remote, np.arange(4))
    # rows: 0 device->device, 1 host<-host, 2 device<-host, 3 host<-device: four pairs, each row once
    assert len(read.handles) == 4
    pairs = {(lists[lo][1], lists[ro][1]): (li, ri) for lo, li, ro, ri in fake_agent._agent.reads}
    assert pairs == {(VRAM, VRAM): ([0], [0]), (DRAM, DRAM): ([0], [0]), (VRAM, DRAM): ([1], [1]), (DRAM, VRAM): ([1], [1])}
    fake_agent.post(read, "trainer rank 0")
    assert fake_agent.wait([(read, "trainer rank 0")], 1e18, "test")
    fake_agent.release_list(local)
    assert sorted(fake_agent._agent.released) == [0, 1]


def test_rows_outside_registered_or_published_memory_are_one_line_errors(fake_agent):
    host = torch.zeros(8)
    fake_agent.register([host])
    with pytest.raises(WeightplanError, match="lies in no registered memory"):
        fake_agent.prepare(None, np.array([[host.data_ptr() + 16, 32]]))  # runs 16 bytes past the tensor
    with pytest.raises(SyncError, match="job.trainer.0: a descriptor .* lies in no registered memory of that process"):
        fake_agent.prepare("job.trainer.0", np.array([[4096, 8]]), MemoryMap.of([Span(8192, 64, HOST)]))


def test_touching_registrations_stay_apart():
    memory = MemoryMap.of([Span(0x1000, 16, HOST), Span(0x1010, 16, HOST), Span(0x1000, 8, HOST)])
    assert memory.locate(np.array([[0x1000, 16], [0x1008, 16], [0x1010, 16]])).tolist() == [0, -1, 0]


@pytest.mark.parametrize("record", [
    None, "x", [[0, 8, "DRAM"]], [[0, 8, "HBM", 0]], [[0, 8, "DRAM", 1]], [[-1, 8, "DRAM", 0]], [[0, 8, "VRAM", 1 << 20]],
    [[True, 8, "DRAM", 0]], [[(1 << 64) - 4, 8, "DRAM", 0]], [[0, 64, "DRAM", 0], [32, 64, "VRAM", 0]],
])
def test_a_malformed_published_memory_record_is_one_line(record):
    with pytest.raises(SyncError, match="trainer rank 3: its info's 'memory'") as err:
        MemoryMap.from_record(record, "trainer rank 3")
    assert "\n" not in str(err.value)


class RecordingStream:
    """A fake device stream: each wait records what the protocol had exposed at that moment."""

    def __init__(self, snapshot):
        self.snapshot, self.seen = snapshot, []

    def synchronize(self) -> None:
        self.seen.append(self.snapshot())


@pytest.fixture
def bf16_plan(plan_cache):
    return load_plan(plan_cache("tiny-glm", "hf", "bf16", "fsdp=1", "tp=1"))


def test_a_sender_exposes_a_version_only_after_waiting_for_its_device_and_a_receiver_sets_it_after_derived_state(
        bf16_plan, rendezvous):
    plan = bf16_plan
    sender = Sender(plan, 0, shard(plan, full_weights(plan, 0, 1), 0), rendezvous=rendezvous, timeout=5,
                    progress="thread").start()
    destination = plain_destination(plan, 0)
    receiver = Receiver(plan, 0, destination, rendezvous=rendezvous, timeout=5, derived="caller").start()
    assert sender.device_sync.devices == () and receiver.device_sync.devices == ()  # host tensors: nothing to wait for
    gpu = (torch.device("cuda", 0),)
    trainer_stream = RecordingStream(lambda: (int(sender._seq), rendezvous.exists(protocol.version_key(0, 1))))
    sender.device_sync = DeviceSync(gpu, lambda device: [trainer_stream])
    engine_stream = RecordingStream(lambda: receiver.version)
    receiver.device_sync = DeviceSync(gpu, lambda device: [engine_stream])
    try:
        sender.publish(1)
        # waited while the sequence word was odd (staging) and before the version record existed
        assert trainer_stream.seen == [(3, False)] and sender.device_sync.calls == [
            "publish: the trainer's kernels, casts and packing"]
        receiver.sync(1)
        assert engine_stream.seen == [None] and receiver.version == 1
        assert receiver.device_sync.calls == ["derived state"]
        expected = host_reference(plan, full_weights(plan, 0, 1), 0)
        assert all(byte_equal(t, destination[n]) for n, t in expected.items())
    finally:
        sender.close()
        receiver.close()


def test_a_receiver_waits_for_each_quantized_group_before_its_staging_slot_is_reused(plan_cache, rendezvous):
    from ..support.fp8 import CASES

    model, fmt, trainer, inference = CASES["unaligned"]  # blocks straddle trainer ranks: the receiver quantizes them
    plan = load_plan(plan_cache(model, fmt, "bf16", trainer, inference, quant="fp8_per_block"))
    weights = full_weights(plan, 0, 1)
    senders = [Sender(plan, r, shard(plan, weights, r), rendezvous=rendezvous, timeout=10, progress="thread").start()
               for r in range(plan.header.src_ranks)]
    receiver = Receiver(plan, 0, plain_destination(plan, 0), rendezvous=rendezvous, timeout=10, derived="caller",
                        group_bytes=1 << 16).start()
    stream = RecordingStream(lambda: receiver.version)
    receiver.device_sync = DeviceSync((torch.device("cuda", 0),), lambda device: [stream])
    receiver._quant._dirty = True  # as after a failed sync: the slots are zeroed, and waited for, before any READ
    try:
        for s in senders:
            s.publish(1)
        receiver.sync(1)
        quantized = receiver.device_sync.calls.count("quantized a group")
        assert receiver.device_sync.calls[0] == "staging slots zeroed"
        assert quantized == receiver.n_groups > 1 and receiver.device_sync.calls[-1] == "derived state"
        assert set(stream.seen) == {None}  # every wait came before the version was set
    finally:
        for s in senders:
            s.close()
        receiver.close()


def test_fp8_plans_with_one_rank_on_several_devices_or_an_unknown_fp8_path_are_refused_in_one_line(plan_cache, no_agents):
    from ..support.fp8 import CASES

    model, fmt, trainer, inference = CASES["aligned"]
    plan = load_plan(plan_cache(model, fmt, "bf16", trainer, inference, quant="fp8_per_block"))
    tensors = shard(plan, full_weights(plan, 0, 1), 0)
    mixed = {name: on_cuda(t, 0) if i % 2 else t for i, (name, t) in enumerate(tensors.items())}
    destination = plain_destination(plan, 0)
    mixed_destination = {name: on_cuda(t, 1) if i % 2 else t for i, (name, t) in enumerate(destination.items())}
    for make, message in [
        (lambda: Sender(plan, 0, mixed, rendezvous=None), r"trainer rank 0: fp8 plans with tensors on several devices \(cpu, cuda:0\)"),
        (lambda: Receiver(plan, 0, mixed_destination, rendezvous=None, derived="caller"),
         r"inference rank 0: fp8 plans with tensors on several devices \(cpu, cuda:1\)"),
        (lambda: Sender(plan, 0, tensors, rendezvous=None, fp8_path="gpu"), "trainer rank 0: fp8_path 'gpu' is not one of auto, device"),
        (lambda: Receiver(plan, 0, destination, rendezvous=None, derived="caller", fp8_path="numba"),
         "inference rank 0: fp8_path 'numba'"),
    ]:
        with pytest.raises(WeightplanError, match=message) as err:
            make()
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("memory", ["missing", "a GPU the trainer does not have"])
def test_a_trainer_info_whose_memory_record_is_wrong_fails_the_sync_in_one_line(bf16_plan, rendezvous, memory):
    plan = bf16_plan
    sender = Sender(plan, 0, shard(plan, full_weights(plan, 0, 1), 0), rendezvous=rendezvous, timeout=5,
                    progress="thread").start()
    receiver = Receiver(plan, 0, plain_destination(plan, 0), rendezvous=rendezvous, timeout=2, derived="caller").start()
    try:
        sender.publish(1)
        info = rendezvous.get_json(protocol.trainer_info_key(0))
        if memory == "missing":
            del info["memory"]
            expected = "trainer rank 0: its info's 'memory' is not a list"
        else:  # the same spans claimed as device memory: NIXL finds no such registration
            info["memory"] = [[a, n, VRAM, 0] for a, n, _, _ in info["memory"]]
            expected = "trainer rank 0: its info's .* name memory it did not register"
        rendezvous.put(protocol.trainer_info_key(0), info)
        with pytest.raises(SyncError, match=expected) as err:
            receiver.sync(1)
        assert "\n" not in str(err.value) and receiver.version is None
    finally:
        sender.close()
        receiver.close()


def test_digests_and_verify_with_tensors_on_a_gpu_are_refused_in_one_line(bf16_plan, no_agents):
    # delta syncs on device tensors run the Triton kernels (runtime/delta/device.py, tests/runtime/test_delta_triton.py)
    plan = bf16_plan
    tensors = {name: on_cuda(t, 0) for name, t in shard(plan, full_weights(plan, 0, 1), 0).items()}
    destination = {name: on_cuda(t, 0) for name, t in plain_destination(plan, 0).items()}
    for make, message in [
        (lambda: Sender(plan, 0, tensors, rendezvous=None, verify=True), r"trainer rank 0: verify=True need host tensors"),
        (lambda: Receiver(plan, 0, destination, rendezvous=None, derived="caller", verify=True),
         r"inference rank 0: verify=True need host tensors .* on cuda:0"),
        (lambda: Receiver(plan, 0, destination, rendezvous=None, derived="caller", verify=True, delta=0.5),
         r"inference rank 0: verify=True need host tensors"),
    ]:
        with pytest.raises(WeightplanError, match=message) as err:
            make()
        assert "\n" not in str(err.value)
