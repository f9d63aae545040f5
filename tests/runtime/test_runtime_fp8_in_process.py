"""fp8_per_block plans through Sender and Receiver in one process: equal to the host executor, verified, bad inputs refused."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from weightplan.runtime import PlanMismatchError, Receiver, Rendezvous, Sender, SyncError, execute_local, load_plan
from weightplan.runtime.fp8.numerics import BlockQuantizer
from weightplan.runtime.plan.schema import GATHER, RECEIVER, SENDER
from weightplan.runtime.transport import protocol


from weightplan.testing.runtime_worker import byte_equal, full_weights, plain_destination, shard
from ..support.fp8 import CASES


@pytest.fixture
def fp8_plan(plan_cache):
    def get(case: str):
        model, fmt, trainer, inference = CASES[case]
        return load_plan(plan_cache(model, fmt, "bf16", trainer, inference, quant="fp8_per_block"))

    return get


def _world(plan, rendezvous, fp8_path="auto", sender_fp8_path=None, **receiver_kwargs):
    """Every trainer and inference rank of `plan` in this process, trainers holding version 1's shards; the trainers
    quantize on `sender_fp8_path` (default: `fp8_path`), the inference ranks on `fp8_path`."""
    full = full_weights(plan, 0, 1)
    tensors = {r: shard(plan, full, r) for r in range(plan.header.src_ranks)}
    # Both ends in one process: the targets need NIXL's progress thread.
    # One store client per trainer, as in separate processes: a client blocked in wait() serves no other thread.
    senders = [Sender(plan, r, tensors[r], rendezvous=Rendezvous.connect(rendezvous.job, rendezvous.address), timeout=10,
                      verify=True, progress="thread", fp8_path=sender_fp8_path or fp8_path).start()
               for r in range(plan.header.src_ranks)]
    destinations = {k: plain_destination(plan, k) for k in range(plan.header.dst_ranks)}
    receivers = [Receiver(plan, k, destinations[k], rendezvous=rendezvous, timeout=10, derived="caller", fp8_path=fp8_path,
                          **receiver_kwargs).start()
                 for k in destinations]
    return tensors, senders, destinations, receivers


def _publish_all(senders, version):
    """Every trainer publishes at once, as trainer processes do: gathering ranks wait for the peers they read."""
    with ThreadPoolExecutor(len(senders)) as pool:
        list(pool.map(lambda sender: sender.publish(version), senders))


def _step(plan, tensors, version):
    """An optimizer step: version `version`'s values written into the trainers' tensors in place."""
    full = full_weights(plan, 0, version)
    for r, local in tensors.items():
        for name, value in shard(plan, full, r).items():
            local[name].copy_(value)


def _assert_equal_to_host(plan, destinations, version):
    """Byte for byte what the host executor writes for every inference rank (one execute_local call for all)."""
    full = full_weights(plan, 0, version)
    expected = {k: plain_destination(plan, k) for k in destinations}
    execute_local(plan, {r: shard(plan, full, r) for r in range(plan.header.src_ranks)}, expected)
    for k, destination in destinations.items():
        differ = [n for n, t in expected[k].items() if not byte_equal(t, destination[n])]
        assert expected[k] and not differ, (k, differ[:5])


# Every trainer is a NIXL target here and needs a spinning progress thread, so the in-process cases are the
# two-trainer ones; tests/runtime/test_runtime_fp8.py runs all cases between processes. 64 KiB groups make many
# groups share the two staging slots (deepseek's padded experts leave windows that must be re-zeroed).
@pytest.mark.parametrize("case,group_bytes", [("aligned", 256 << 20), ("deepseek", 64 << 10)])
def test_fp8_syncs_equal_the_host_executor(fp8_plan, rendezvous, case, group_bytes):
    plan = fp8_plan(case)
    tensors, senders, destinations, receivers = _world(plan, rendezvous, verify=True, group_bytes=group_bytes)
    for version in (1, 2):
        if version > 1:
            _step(plan, tensors, version)
        _publish_all(senders, version)
        reports = [receiver.sync(version) for receiver in receivers]
        assert all(r.version == version and r.verify_seconds is not None for r in reports)
        _assert_equal_to_host(plan, destinations, version)
        for sender in senders:
            sender.release(version, timeout=2)
    for receiver in receivers:
        held = [e for e in plan.staging if receiver.rank in e.ranks]
        # Staging holds only blocks the receiver quantizes, at most two pipeline groups of them.
        assert receiver.stats.staging_bytes <= 2 * sum(e.numel for e in held)
        if group_bytes < (1 << 20) and receiver.n_groups > 2:
            assert receiver.stats.staging_bytes < 2 * sum(e.numel for e in held)
    sender_spans = plan.spans["side"] != RECEIVER  # sender and gather sides: quantized and served by a trainer
    for sender in senders:
        mine = sender_spans & (plan.spans["src_rank"] == sender.rank)
        assert (sender._quant.scales.numel() > 0) == bool(mine.any())
        assert sender.quantize_seconds >= 0


def test_fp8_syncs_through_the_device_path_equal_the_host_executor(fp8_plan, rendezvous, monkeypatch):
    """fp8_path="device" on every rank runs what a GPU rank runs (fp8 regions, stage copies, gather buffer and staging
    slots on the tensors' device, gathers and quantization in torch ops), here on host tensors: the numba kernel is
    never called, the digests verify, and the bytes equal the host executor's. DeepSeek-V3 shapes over fsdp=3 / tp=2
    have blocks of all three sides (sender, gather, receiver) and edge blocks."""
    def no_kernel(*args):
        raise AssertionError("the device path must not use the numba kernel")

    monkeypatch.setattr(BlockQuantizer, "_kernel_tiles", no_kernel)
    plan = fp8_plan("deepseek")
    tensors, senders, destinations, receivers = _world(plan, rendezvous, fp8_path="device", verify=True,
                                                       group_bytes=64 << 10)
    assert any(s._gather is not None for s in senders) and any(r._quant.quantizes for r in receivers)
    assert all(not s._quant._quantize.use_kernel for s in senders) and all(not r._quant._quantize.use_kernel for r in receivers)
    for version in (1, 2):
        if version > 1:
            _step(plan, tensors, version)
        _publish_all(senders, version)
        assert all(receiver.sync(version).verify_seconds is not None for receiver in receivers)
        _assert_equal_to_host(plan, destinations, version)
        for sender in senders:
            sender.release(version, timeout=2)


# make test runs each direction and each rounding once; the other two pairings run in make test-extended
@pytest.mark.parametrize("sender_path,receiver_path,rounding", [
    ("auto", "device", "cuda"), ("device", "auto", "ieee"),
    *(pytest.param(*case, marks=pytest.mark.extended) for case in (("auto", "device", "ieee"), ("device", "auto", "cuda"))),
])
def test_blocks_quantized_by_different_paths_end_as_one_paths_bytes(plan_cache, rendezvous, rounding, sender_path,
                                                                    receiver_path):
    """Trainers quantizing their (sender- and gather-side) blocks on one path and inference ranks their receiver-side
    blocks on the other (numba kernel vs torch ops) leave every tensor bit-equal to the host executor's single path,
    under either scale rounding; and the rounding is the plan's: the other one's bytes differ."""
    model, fmt, trainer, inference = CASES["deepseek"]
    plan = load_plan(plan_cache(model, fmt, "bf16", trainer, inference, quant="fp8_per_block", scale_rounding=rounding))
    assert plan.header.quant_layout.scale_rounding.value == rounding
    tensors, senders, destinations, receivers = _world(plan, rendezvous, fp8_path=receiver_path, sender_fp8_path=sender_path,
                                                       verify=True, group_bytes=64 << 10)
    assert {s._quant._quantize.use_kernel for s in senders} == {sender_path == "auto"}
    assert {r._quant._quantize.use_kernel for r in receivers if r._quant.quantizes} == {receiver_path == "auto"}
    assert any(s._gather is not None for s in senders) and any(r._quant.quantizes for r in receivers)
    _publish_all(senders, 1)
    assert all(receiver.sync(1).verify_seconds is not None for receiver in receivers)
    _assert_equal_to_host(plan, destinations, 1)
    layout = plan.header.quant_layout
    other = dataclasses.replace(layout, scale_rounding=next(r for r in type(layout.scale_rounding) if r != layout.scale_rounding))
    with pytest.raises(AssertionError):
        _assert_equal_to_host(dataclasses.replace(plan, header=dataclasses.replace(plan.header, quant_layout=other)),
                              destinations, 1)
    for sender in senders:
        sender.release(1, timeout=2)


def test_one_changed_fp8_byte_scale_or_staged_value_fails_verification(fp8_plan, rendezvous):
    plan = fp8_plan("aligned")
    tensors, senders, destinations, receivers = _world(plan, rendezvous, verify=True)
    receiver = receivers[0]
    corruptions = [
        (lambda s: s._quant.fp8, r"fused_qkv_a_proj\.weight \(from trainer rank 0\)"),
        (lambda s: s._quant.scales.view(torch.uint8), r"fused_qkv_a_proj\.weight_scale_inv \(from trainer rank 0\)"),
        (lambda s: s._quant.stage_packed, r"\(bf16 staging\) \(from trainer rank 0\)"),
    ]
    for version, (region, message) in enumerate(corruptions, start=1):
        _publish_all(senders, version)
        region(senders[0])[0] ^= 0x01  # after publish: the sender hashed the bytes before this flip
        with pytest.raises(SyncError, match=f"verification failed for 1 regions, e.g. .*{message}"):
            receiver.sync(version)
        assert receiver.version is None
    version = len(corruptions) + 1
    _step(plan, tensors, version)
    _publish_all(senders, version)
    receiver.sync(version)  # a later sync restores consistent weights (staging left dirty is cleared)
    assert receiver.version == version
    _assert_equal_to_host(plan, destinations, version)


def test_a_trainer_exposing_other_fp8_regions_is_refused(fp8_plan, rendezvous):
    plan = fp8_plan("aligned")
    tensors, senders, destinations, receivers = _world(plan, rendezvous)
    info = rendezvous.get_json("trainer/1/info")
    info["quant"]["fp8"][1] += 128
    rendezvous.put("trainer/1/info", info)
    _publish_all(senders, 1)
    with pytest.raises(PlanMismatchError, match="trainer rank 1 exposes fp8 regions"):
        receivers[0].sync(1)
    assert receivers[0].version is None


def test_bad_fp8_inputs_are_refused_before_any_agent(no_agents, rendezvous, fp8_plan):
    plan = fp8_plan("aligned")
    tensors = shard(plan, full_weights(plan, 0, 1), 0)
    destination = plain_destination(plan, 0)
    # A source this rank only quantizes itself (never exposed) is still required.
    local_only = sorted(set(plan.stage["src"][(plan.stage["side"] == SENDER) & (plan.stage["src_rank"] == 0)].tolist())
                        - set(plan.runs["src"][plan.runs["src_rank"] == 0].tolist())
                        - set(plan.stage["src"][(plan.stage["side"] != SENDER) & (plan.stage["src_rank"] == 0)].tolist()))
    assert local_only
    name = plan.sources[local_only[0]].name
    with pytest.raises(PlanMismatchError, match=f"trainer rank 0 tensors missing: {name}"):
        Sender(plan, 0, {n: t for n, t in tensors.items() if n != name}, rendezvous=rendezvous)
    weight = plan.dests[plan.staging[0].weight].name
    scale = plan.dests[plan.staging[0].scale].name
    with pytest.raises(PlanMismatchError, match=f"tensor '{weight}' is bfloat16.*expects float8_e4m3fn"):
        Receiver(plan, 0, {**destination, weight: destination[weight].to(torch.bfloat16)}, rendezvous=rendezvous)
    with pytest.raises(PlanMismatchError, match=f"inference rank 0 tensors missing: {scale}"):
        Receiver(plan, 0, {n: t for n, t in destination.items() if n != scale}, rendezvous=rendezvous)
    other_layout = _with_header(plan, quant_layout=dataclasses.replace(plan.header.quant_layout, layout="deepgemm_ue8m0"))
    for make in (lambda: Sender(other_layout, 0, tensors, rendezvous=rendezvous),
                 lambda: Receiver(other_layout, 0, destination, rendezvous=rendezvous)):
        with pytest.raises(PlanMismatchError, match="executes only the plain layout with 128x128 blocks"):
            make()
    staging = list(plan.staging)
    staging[0] = dataclasses.replace(staging[0], dtype="float16")
    with pytest.raises(PlanMismatchError, match="executes 2-D/3-D bfloat16 staging"):
        Receiver(_with_header(plan, staging=tuple(staging)), 0, destination, rendezvous=rendezvous)


def _with_header(plan, **changes):
    """The plan with these header fields changed (in memory: the fingerprint no longer matches)."""
    return dataclasses.replace(plan, header=dataclasses.replace(plan.header, **changes))


def test_receivers_read_only_what_they_quantize(fp8_plan):
    """Receiver-side stage runs are cut to the block rows the receiver quantizes, so the bf16 read is at most the plan's."""
    from weightplan.runtime.plan.schema import RECEIVER
    from weightplan.runtime.tables.quant import quant_tables

    for case in CASES:
        plan = fp8_plan(case)
        tables = quant_tables(plan)
        c = tables.copies
        planned = int(plan.stage["length"][plan.stage["side"] == RECEIVER].sum())
        assert int(c.length[c.side == RECEIVER].sum()) <= planned
        sender = c.side == SENDER
        window_owner = tables.windows.src_rank[c.window]
        assert np.array_equal(window_owner[sender], c.src_rank[sender]), "a sender window is fed only by its own rank"


def test_gathering_checks_that_its_peers_hold_the_version_stable(fp8_plan, rendezvous):
    """DeepSeek-V3 under TP=2: q_a/kv_a are replicated on both inference ranks, so their blocks across the
    two trainer shards are gathered. A peer announcing `staged` while its sequence word says otherwise, or a
    peer that never stages, fails the gathering rank's publish, which then announces nothing."""
    plan = fp8_plan("deepseek")
    tensors, senders, destinations, receivers = _world(plan, rendezvous)
    gathering = [s for s in senders if s._gather is not None]
    assert gathering and (plan.spans["side"] == GATHER).any()
    gatherer = gathering[0]
    for peer in gatherer._gather.peers:  # claims to have staged version 1, but its sequence word is still odd
        rendezvous.put(protocol.staged_key(peer, 1), senders[peer].incarnation.encode())
    with pytest.raises(SyncError, match=r"trainer rank \d no longer holds version 1 stable"):
        gatherer.publish(1)
    assert not rendezvous.exists(protocol.version_key(gatherer.rank, 1))
    gatherer.timeout = 0.5
    with pytest.raises(SyncError, match=r"gather-side bf16 of version 2 from trainer ranks \[\d\]: not published within"):
        gatherer.publish(2)
    assert not rendezvous.exists(protocol.version_key(gatherer.rank, 2))
    # All trainers publishing together then works, and the replicated blocks equal the host executor's.
    _step(plan, tensors, 3)
    _publish_all(senders, 3)
    for receiver in receivers:
        receiver.sync(3)
    _assert_equal_to_host(plan, destinations, 3)
