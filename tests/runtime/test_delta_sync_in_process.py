"""Delta syncs through Sender and Receiver in one process (NIXL agents on loopback): delta and full syncs in one job,
a receiver that misses a version or restarts, bf16 and fp32 masters, the ring, fp8_per_block; bad deltas refused
with nothing applied. Every sync is checked byte for byte against the host executor and with verify=True."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from weightplan.runtime import Receiver, Rendezvous, Sender, SyncError, execute_local, load_plan
from weightplan.runtime.delta.rates import DeltaRates
from weightplan.runtime.transport import protocol
from weightplan.runtime.transport.region_digests import byte_view

from ..support.fp8 import CASES
from ..support.syncs import sync_while_released
from weightplan.testing.runtime_worker import byte_equal, full_weights, plain_destination, shard

# Syncs that are expected to succeed wait long: a loaded host (other jobs on 2 cores) must not fail them.
TIMEOUT = 30
SLOW_READ = DeltaRates(read_gbytes_per_s=1e-3)


def _world(plan, rendezvous, receivers=None, ring_bytes=512 << 20, delta=0.5, secret=None, **receiver_kwargs):
    """Every trainer rank of `plan` (keeping deltas) and the given inference ranks in this process, at version 1's weights.
    Receivers READ at an assumed slow rate unless told otherwise: every delta smaller than full is taken (density 0.01
    sits near the host codec's crossover with loopback READs), so these tests prove the delta path itself."""
    receiver_kwargs.setdefault("delta_rates", SLOW_READ)
    full = full_weights(plan, 0, 1)
    tensors = {r: shard(plan, full, r) for r in range(plan.header.src_ranks)}
    # one store client per trainer: a client blocked in wait() serves no other thread (gathering fp8 trainers)
    senders = [Sender(plan, r, tensors[r], rendezvous=Rendezvous.connect(rendezvous.job, rendezvous.address, secret=secret), timeout=TIMEOUT,
                      verify=True, progress="thread", ring_bytes=ring_bytes, delta=delta).start()
               for r in range(plan.header.src_ranks)]
    ranks = range(plan.header.dst_ranks) if receivers is None else receivers
    destinations = {k: plain_destination(plan, k) for k in ranks}
    readers = {k: Receiver(plan, k, destinations[k], rendezvous=rendezvous, timeout=TIMEOUT, derived="caller", verify=True,
                           ring_bytes=ring_bytes, delta=delta, **receiver_kwargs).start() for k in ranks}
    return tensors, senders, destinations, readers


def _train(tensors, density: float, seed: int) -> None:
    """An optimizer step that changes about `density` of every trainer tensor's elements, in place."""
    g = torch.Generator().manual_seed(seed)
    for local in tensors.values():
        for t in local.values():
            flat = t.view(-1)
            hit = torch.rand(flat.numel(), generator=g) < density
            flat[hit] = torch.randn(int(hit.sum()), generator=g).to(t.dtype)


def _publish(senders, version, timeout=0.3):
    for s in senders:
        if s._pending is not None:
            s.release(s._pending, timeout=timeout)  # a receiver that skips a version is not waited for long
    with ThreadPoolExecutor(len(senders)) as pool:
        list(pool.map(lambda s: s.publish(version), senders))


def _assert_equal_to_host(plan, tensors, destinations):
    expected = {k: plain_destination(plan, k) for k in destinations}
    execute_local(plan, tensors, expected)
    for k, destination in destinations.items():
        differ = [n for n, t in expected[k].items() if not byte_equal(t, destination[n])]
        assert expected[k] and not differ, (k, differ[:5])


@pytest.fixture
def tp2_plan(plan_cache):
    return lambda dtype: load_plan(plan_cache("tiny-glm", "hf", dtype, "fsdp=1", "tp=2"))


def _sync(senders, receivers, version, release_timeout=5.0, returning=()):
    """The receivers' reports of `version` synced while released (tests/support/syncs.py)."""
    return sync_while_released(senders, receivers, version, release_timeout, returning)[0]


@pytest.mark.parametrize("dtype,ring_bytes", [("bf16", 512 << 20), ("fp32", 512 << 20), ("bf16", 32 << 10)])
def test_delta_and_full_syncs_in_one_job_with_a_receiver_that_misses_a_version(tp2_plan, rendezvous, dtype, ring_bytes):
    plan = tp2_plan(dtype)
    tensors, senders, destinations, readers = _world(plan, rendezvous, ring_bytes=ring_bytes)
    r0, r1 = readers[0], readers[1]
    if ring_bytes < 512 << 20:
        assert senders[0].ring is not None and len(senders[0].ring) > 1
    _publish(senders, 1)
    first = _sync(senders, [r0, r1], 1)
    assert [r.took for r in first] == ["full", "full"]  # nothing to apply a delta to yet
    _assert_equal_to_host(plan, tensors, destinations)
    full_bytes = first[0].bytes
    took = {}
    for version in (2, 3, 4):
        _train(tensors, 0.01, version)
        _publish(senders, version)
        stats = senders[0].delta_stats
        assert stats.base == version - 1 and 0.002 < stats.density < 0.03, stats
        syncing = [r0] if version == 2 else [r0, r1]  # inference rank 1 misses version 2
        for report in _sync(senders, syncing, version, release_timeout=3.0 if version == 2 else 5.0,
                            returning=[r1] if version == 3 else ()):
            took[(report.rank, version)] = report.took
            assert report.verify_seconds is not None and report.version == version
            if report.took == "delta":
                assert report.delta_trainers == (0,) and 0 < report.bytes < 0.15 * full_bytes, report
        _assert_equal_to_host(plan, tensors, {r.rank: destinations[r.rank] for r in syncing})
    assert took == {(0, 2): "delta", (0, 3): "delta", (1, 3): "full", (1, 4): "delta", (0, 4): "delta"}


def test_a_restarted_receiver_and_one_whose_destination_was_written_take_a_full_sync(tp2_plan, rendezvous):
    plan = tp2_plan("bf16")
    tensors, senders, destinations, readers = _world(plan, rendezvous, receivers=[0])
    receiver = readers[0]
    _publish(senders, 1)
    assert receiver.sync(1).took == "full"
    _train(tensors, 0.01, 2)
    _publish(senders, 2)
    assert receiver.sync(2).took == "delta"
    receiver.close()  # a restart: a new process holds whatever its destination holds, and no version
    restarted = Receiver(plan, 0, destinations[0], rendezvous=rendezvous, timeout=TIMEOUT, derived="caller", verify=True,
                         delta=0.5).start()
    _train(tensors, 0.01, 3)
    _publish(senders, 3)
    assert restarted.sync(3).took == "full"
    _assert_equal_to_host(plan, tensors, destinations)
    _train(tensors, 0.01, 4)
    _publish(senders, 4)
    assert restarted.sync(4).took == "delta"
    _assert_equal_to_host(plan, tensors, destinations)
    name = next(iter(destinations[0]))
    destinations[0][name].fill_(3.0)  # the caller writes the destination itself (a load_weights), then says so
    restarted.write_constants()
    _train(tensors, 0.01, 5)
    _publish(senders, 5)
    assert restarted.sync(5).took == "full"
    _assert_equal_to_host(plan, tensors, destinations)


def _corrupt_blob(sender):
    blob_end = int(sender._delta.index[3:].max())
    region = byte_view(sender._delta.region)
    region[8 : blob_end] ^= 0x5A  # every value and position of the page blobs


def _forge_index(sender, rendezvous, version, change):
    """A process of the job (it holds the secret) rewrites its index and record consistently: only the checks of the
    index's contents are left to catch it."""
    index = sender._delta.index
    change(index)
    record = protocol.DeltaRecord(int(index[1]), int(index[3:].max()), hashlib.sha256(byte_view(index)).hexdigest())
    rendezvous.put(protocol.delta_key(sender.rank, version), protocol.delta_record(record))


@pytest.mark.parametrize("bad,message", [
    ("blob", r"its delta of version 2, page \d+ \(\w+ \d+ at byte \d+\): "),
    ("index", "has a page index that is not the one its record names"),
    ("beyond", r"its pages end at byte \d+, beyond its region of \d+ bytes"),
    ("base", "its index says version 2, base 7"),
])
def test_bad_deltas_are_refused_in_one_line_with_nothing_applied(tp2_plan, rendezvous, bad, message):
    plan = tp2_plan("bf16")
    tensors, senders, destinations, readers = _world(plan, rendezvous, receivers=[0])
    receiver, sender = readers[0], senders[0]
    _publish(senders, 1)
    receiver.sync(1)
    before = {n: t.clone() for n, t in destinations[0].items()}
    _train(tensors, 0.01, 2)
    _publish(senders, 2)
    if bad == "blob":
        _corrupt_blob(sender)
    elif bad == "index":
        sender._delta.index[5] += 1
    elif bad == "beyond":
        _forge_index(sender, rendezvous, 2, lambda i: i.__setitem__(-1, sender._delta.region.numel() + 8))
    else:
        _forge_index(sender, rendezvous, 2, lambda i: i.__setitem__(1, 7))
        rendezvous.put(protocol.delta_key(0, 2), {**rendezvous.get_json(protocol.delta_key(0, 2)), "base": 1})
    with pytest.raises(SyncError, match=message) as error:
        receiver.sync(2)
    assert "\n" not in str(error.value) and receiver.version is None
    assert all(byte_equal(t, destinations[0][n]) for n, t in before.items())  # nothing applied
    _train(tensors, 0.01, 3)
    _publish(senders, 3)
    assert receiver.sync(3).took == "full"  # after a failed sync, never a delta
    _assert_equal_to_host(plan, tensors, destinations)


# the DeepSeek-V3 case (unaligned blocks across shards) runs in make test-extended
@pytest.mark.parametrize("case", ["aligned", pytest.param("deepseek", marks=pytest.mark.extended)])
def test_fp8_per_block_delta_syncs_equal_the_host_executor(plan_cache, rendezvous, case):
    model, fmt, trainer, inference = CASES[case]
    plan = load_plan(plan_cache(model, fmt, "bf16", trainer, inference, quant="fp8_per_block"))
    # a changed bf16 element requantizes its whole block: dense fp8 deltas, which the default rates would read full
    tensors, senders, destinations, readers = _world(plan, rendezvous, group_bytes=64 << 10)
    _publish(senders, 1)
    assert all(r.sync(1).took == "full" for r in readers.values())
    for version in (2, 3):
        _train(tensors, 0.01, version)
        _publish(senders, version)
        reports = [r.sync(version) for r in readers.values()]
        assert all(r.took == "delta" for r in reports), [r.why for r in reports]
        _assert_equal_to_host(plan, tensors, destinations)
    # fp8 values and scales are diffed after quantization: a changed bf16 element changes its whole block's scale
    assert any(s.delta_stats.density > 0 for s in senders)


def test_sides_without_deltas_or_room_for_them_sync_full(tp2_plan, rendezvous):
    plan = tp2_plan("bf16")
    tensors, senders, destinations, _ = _world(plan, rendezvous, receivers=[])
    destinations = {0: plain_destination(plan, 0)}
    plain = {1: plain_destination(plan, 1)}
    # a delta staging of 64 bytes, too small for any delta of this plan, and a receiver without deltas
    small = Receiver(plan, 0, destinations[0], rendezvous=rendezvous, timeout=TIMEOUT, derived="caller", verify=True,
                     delta=1e-9).start()
    without = Receiver(plan, 1, plain[1], rendezvous=rendezvous, timeout=TIMEOUT, derived="caller", verify=True).start()
    _publish(senders, 1)
    _sync(senders, [small, without], 1)
    _train(tensors, 0.01, 2)
    _publish(senders, 2)
    assert [r.took for r in _sync(senders, [small, without], 2)] == ["full", "full"]
    _assert_equal_to_host(plan, tensors, {**destinations, **plain})
    # trainers without deltas: a receiver that keeps them reads full
    for s in senders:
        s.release(2, timeout=1.0)
        s.close()
    no_delta = [Sender(plan, 0, tensors[0], rendezvous=rendezvous, timeout=TIMEOUT, verify=True, progress="thread").start()]
    small.close()
    keeps = Receiver(plan, 0, destinations[0], rendezvous=rendezvous, timeout=TIMEOUT, derived="caller", verify=True,
                     delta=0.5).start()
    for version in (3, 4):
        _train(tensors, 0.01, version)
        _publish(no_delta, version)
        assert _sync(no_delta, [keeps], version)[0].took == "full"
    _assert_equal_to_host(plan, tensors, {0: destinations[0]})


def test_a_delta_record_forged_without_the_job_secret_is_never_read(tp2_plan, request):
    plan = tp2_plan("bf16")
    secret = "delta-test-secret-0123456789"
    served = Rendezvous.connect(f"delta-{request.node.name[:20]}", "127.0.0.1:0", serve=True, secret=secret)
    tensors, senders, destinations, readers = _world(plan, served, receivers=[0], secret=secret)
    receiver = readers[0]
    _publish(senders, 1)
    receiver.sync(1)
    _train(tensors, 0.01, 2)
    _publish(senders, 2)
    impostor = Rendezvous.connect(served.job, served.address)  # no secret: its keys are not the job's
    impostor.put(protocol.delta_key(0, 2), protocol.delta_record(protocol.DeltaRecord(1, 64, "0" * 64)))
    assert receiver.sync(2).took == "delta"  # the signed record, under its derived key, is the one read
    _assert_equal_to_host(plan, tensors, destinations)


def test_a_delta_predicted_slower_than_full_is_read_full_and_says_why(tp2_plan, rendezvous):
    plan = tp2_plan("bf16")
    tensors, senders, destinations, readers = _world(plan, rendezvous, receivers=[0], delta_rates=DeltaRates())
    receiver = readers[0]
    _publish(senders, 1)
    assert _sync(senders, [receiver], 1)[0].took == "full"
    # a third of the elements change: the delta fits (bitmask pages, ~0.37 of the bytes) but applying it on the host
    # (0.22 GB/s) costs more than reading everything at 7.1 GB/s
    _train(tensors, 0.3, 2)
    _publish(senders, 2)
    dense = _sync(senders, [receiver], 2)[0]
    assert 0.2 < senders[0].delta_stats.density < 0.4
    assert dense.took == "full" and dense.delta_choices and not any(c.taken for c in dense.delta_choices), dense
    assert "full at density" in dense.why and dense.delta_choices[0].delta_seconds > dense.delta_choices[0].full_seconds
    _assert_equal_to_host(plan, tensors, destinations)
    _train(tensors, 0.001, 3)
    _publish(senders, 3)
    sparse = _sync(senders, [receiver], 3)[0]
    assert sparse.took == "delta" and all(c.taken for c in sparse.delta_choices), sparse.why
    assert "delta at density" in sparse.why
    _assert_equal_to_host(plan, tensors, destinations)
    for r in [receiver, *senders]:
        r.close()
