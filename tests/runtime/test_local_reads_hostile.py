"""Same-node reads against crafted trainer records (issue 53): reads bounded by the memory the trainer registered with
NIXL, CUDA IPC shares within torch's own bounds, the trainer's identity checked at every READ, addresses range-checked
without wrap-around, and same-node reads only in a job with a secret."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from weightplan.runtime import Receiver, Rendezvous, Sender, SyncError, load_plan
from weightplan.runtime.transport import local_peer, protocol
from weightplan.runtime.transport.local_peer import LocalReader, Storages, beyond_allocation
from weightplan.runtime.transport.local_record import REF_COUNTERS, CudaShare, HostId, LocalRecord, parse_local
from weightplan.runtime.transport.memory import HOST, MemoryMap, Span
from weightplan.runtime.transport.nixl_agent import NixlAgent

from weightplan.testing.runtime_worker import full_weights, plain_destination, shard
from ..support.local_reads import bf16_plan, cuda_share, pair, read_over_nixl, rendezvous  # noqa: F401 (fixtures)

NOT_REGISTERED = b"NOT-REGISTERED-SECRET-0123456789"


def _secret_bytes(nbytes: int) -> torch.Tensor:
    """A buffer of this process that no Sender registers, holding NOT_REGISTERED over and over."""
    return torch.tensor(list((NOT_REGISTERED * (nbytes // len(NOT_REGISTERED) + 1))[:nbytes]), dtype=torch.uint8)


@pytest.fixture
def reads(monkeypatch):
    """Every (pid, remote address, bytes) a LocalReader reads with process_vm_readv, recorded before it reads."""
    seen = []
    real = local_peer.read

    def recording(pid, plan):
        seen.extend((pid, a, n) for a, n in zip(plan.remote.tolist(), plan.nbytes.tolist()))
        return real(pid, plan)

    monkeypatch.setattr(local_peer, "read", recording)
    return seen


def _inside(memory: MemoryMap, seen: list) -> bool:
    return not seen or bool((memory.locate(np.array([[a, n] for _, a, n in seen])) >= 0).all())


def _repoint(case: str, secret: torch.Tensor):
    """A tamper pointing the trainer's ring word or packed region (`case`, its info field first) into `secret` and
    adding that buffer to its 'memory' (a record widening what it says it registered); with ", memory one span", one
    span from its lowest registered byte to the end of `secret` instead."""
    def tamper(info):
        field, _, one_span = case.partition(", ")
        info[field] = [secret.data_ptr(), info[field][1]]
        spans = info["memory"] + [[secret.data_ptr(), secret.numel(), "DRAM", 0]]
        if one_span:
            low, high = min(s[0] for s in spans), max(s[0] + s[1] for s in spans)
            spans = [[low, high - low, "DRAM", 0]]
        info["memory"] = spans

    return tamper


@pytest.mark.parametrize("case", ["ring", "packed", "packed, memory one span"])
def test_a_record_repointed_at_unregistered_memory_reads_nothing_of_it(bf16_plan, rendezvous, reads, case):
    """The issue's attack: a trainer record whose 'memory' claims a buffer the trainer never registered and whose
    areas point into it. NIXL's record of the trainer's registrations refuses it: one line, nothing read outside
    registered memory, the destination untouched."""
    secret = _secret_bytes(1 << 20)
    with pair(bf16_plan, rendezvous, _repoint(case, secret)) as (sender, destination, receiver):
        before = {n: t.clone() for n, t in destination.items()}
        field = case.partition(", ")[0]
        with pytest.raises(SyncError, match=rf"trainer rank 0: its info's '{field}' .*name memory it did not register") as err:
            receiver.sync(1)
        assert "\n" not in str(err.value) and receiver.version is None
        assert _inside(sender.agent.memory, reads), [r for r in reads if not _inside(sender.agent.memory, [r])]
        assert all(torch.equal(t.view(torch.uint8), before[n].view(torch.uint8)) for n, t in destination.items())
        assert not any(NOT_REGISTERED[:16] in t.view(torch.uint8).numpy().tobytes() for t in destination.values())


def test_a_region_repointed_at_unregistered_memory_reads_nothing_of_it(plan_cache, rendezvous, reads):
    """As above for a source region read in place (vocab-llama's embedding is not packed)."""
    plan = load_plan(plan_cache("vocab-llama", "hf", "bf16", "fsdp=1", "tp=1"))
    secret = _secret_bytes(4 << 20)
    largest = []

    def tamper(info):
        i = max(range(len(info["regions"])), key=lambda k: info["regions"][k][3])
        assert info["regions"][i][3] <= secret.numel()
        info["regions"][i][2] = secret.data_ptr()
        info["memory"].append([secret.data_ptr(), secret.numel(), "DRAM", 0])
        largest.append(i)

    with pair(plan, rendezvous, tamper) as (sender, destination, receiver):
        before = {n: t.clone() for n, t in destination.items()}
        with pytest.raises(SyncError, match=rf"trainer rank 0: its info's 'regions\[{largest[0]}\]' .*did not register"):
            receiver.sync(1)
        assert _inside(sender.agent.memory, reads)
        assert all(torch.equal(t.view(torch.uint8), before[n].view(torch.uint8)) for n, t in destination.items())


def test_a_local_reader_refuses_rows_its_peer_did_not_register_with_nixl(reads):
    """The reader itself, without a Receiver: rows inside the record's (widened) 'memory' but outside what the peer's
    NIXL agent registered are refused before any byte is read."""
    trainer, reader = NixlAgent("hostile.trainer.0"), NixlAgent("hostile.inference.0")
    registered, secret, into = torch.zeros(4096, dtype=torch.uint8), _secret_bytes(4096), torch.zeros(4096, dtype=torch.uint8)
    try:
        trainer.register([registered])
        reader.register([into])
        reader.add_peer(trainer.metadata(), trainer.name)
        widened = MemoryMap.of([Span(registered.data_ptr(), 4096, HOST), Span(secret.data_ptr(), 4096, HOST)])
        bound = local_peer.Registered(reader, trainer.name)
        local = LocalReader(LocalRecord(HostId.here(), os.getpid(), 0, ()), widened,
                            Storages.of([]), Storages.local([into]), "trainer rank 0", bound, bytes(16))
        assert local.prepare(trainer.name, np.array([[registered.data_ptr() + 8, 64]])).table.shape == (1, 2)
        for rows in ([[secret.data_ptr(), 32]], [[registered.data_ptr(), 64], [secret.data_ptr() + 64, 64]]):
            with pytest.raises(SyncError, match="trainer rank 0: NIXL refuses descriptors .*nixlNotFoundError"):
                local.prepare(trainer.name, np.array(rows))
        assert reads == [] and not into.any()
    finally:
        reader.close()
        trainer.close()


def test_a_probe_outside_registered_memory_isread_over_nixl(bf16_plan, rendezvous, caplog):
    """A record whose probe points at a copy of the incarnation the trainer did not register (anyone can copy it: it is
    in its version record) is not opened: the same bytes come over NIXL, with one warning saying why."""
    copy = []

    def tamper(info):
        copy.append(torch.tensor(list(bytes.fromhex(info["incarnation"])), dtype=torch.uint8))
        info["local"]["probe"][0] = copy[0].data_ptr()
        info["memory"].append([copy[0].data_ptr(), 16, "DRAM", 0])

    said = read_over_nixl(bf16_plan, rendezvous, tamper, caplog)
    assert "its probe at" in said and "is not memory it registered with NIXL" in said, said


def test_a_trainer_whose_probe_changes_between_syncs_fails_the_next_sync_at_once(bf16_plan, rendezvous):
    """A recycled pid, simulated: after one sync the process at the trainer's pid no longer holds its incarnation at its
    probe. The next sync fails in one line naming the trainer before reading it, and the trainer is told (fail)."""
    with pair(bf16_plan, rendezvous) as (sender, destination, receiver):
        assert receiver.sync(1).paths == {"process_vm_readv": receiver.stats.bytes}
        sender.release(1, timeout=5)
        sender._probe.fill_(0xAB)  # another process now at that pid, with other bytes there
        sender.publish(2)
        with pytest.raises(SyncError, match=rf"trainer rank 0: process {os.getpid()} of this host does not "
                                            "hold its incarnation at its probe: that trainer exited") as err:
            receiver.sync(2)
        assert "\n" not in str(err.value) and receiver.version is None
        assert sender.release(2, timeout=5).failed == (0,)


def test_a_record_naming_another_live_process_isread_over_nixl(bf16_plan, rendezvous, caplog):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        def tamper(info):
            info["local"]["pid"] = other.pid

        assert f"process {other.pid}" in read_over_nixl(bf16_plan, rendezvous, tamper, caplog)
    finally:
        other.kill()
        other.wait()


def test_without_a_secret_same_node_reads_are_off_and_that_is_said_once(bf16_plan, request, caplog, monkeypatch):
    monkeypatch.delenv("WEIGHTPLAN_SECRET", raising=False)
    monkeypatch.delenv("WEIGHTPLAN_SECRET_FILE", raising=False)
    unsigned = Rendezvous.connect(f"unsigned-{request.node.name[:40]}", "127.0.0.1:0", serve=True)
    caplog.set_level(logging.WARNING, "weightplan.runtime")
    with pair(bf16_plan, unsigned) as (sender, destination, receiver):
        for version in (1, 2):
            if version == 2:
                sender.publish(2)
            report = receiver.sync(version)
            assert report.paths == {"nixl": report.bytes}
            sender.release(version, timeout=5)
            receiver.connections.trainers.drop_all()  # a new connection to it: the reason is not logged again
    said = [r.getMessage() for r in caplog.records if "over NIXL, not directly" in r.getMessage()]
    assert said == ["inference rank 0 reads its trainers over NIXL, not directly: this job has no secret, so any local "
                    "process could have written the trainers' records (same-node reads need WEIGHTPLAN_SECRET_FILE or "
                    "WEIGHTPLAN_SECRET)"], said


# --- the CUDA IPC share: torch's own bounds, checked at parse (no GPU here) ---------------------------------------------

def _local_record(**share_changes) -> dict:
    share = dict(cuda_share().record(), **share_changes)
    return {"host": {"boot_id": "0c6d3ab4-3f6e-4b1a-9d55-0b9a1d7e4c21", "hostname": "node-7"}, "pid": 4242,
            "probe": [0x5555_0000, 16], "cuda": [share]}


@pytest.mark.parametrize("field,value", [
    ("ref_offset", REF_COUNTERS),
    ("ref_offset", (1 << 63) - 1),
    ("ref_offset", -1),
    ("ref_counter", b"/evil_shm".hex()),
    ("ref_counter", b"/torch_4243_3735928559_0".hex()),  # another process's counter file
    ("ref_counter", b"/torch_4242_3735928559_0\x00/evil".hex()),  # torch reads it as a C string
    ("ref_counter", b"/torch_4242_3735928559_0/../../evil".hex()),
    ("ref_counter", b"".hex()),
    ("offset", (1 << 63) - (2 << 20)),  # offset + bytes reach 2**63: torch's ptrdiff_t
    ("bytes", 1 << 63),
    ("address", (1 << 64) - 4096),  # its storage would end past 2**64
])
def test_a_cuda_share_outside_torchs_bounds_is_refused_naming_the_field(field, value):
    with pytest.raises(SyncError, match=rf"trainer rank 0: its info's 'local\.cuda\[0\]\.{field}'") as err:
        parse_local(_local_record(**{field: value}), "trainer rank 0")
    assert "\n" not in str(err.value)


def test_a_cuda_share_within_torchs_bounds_is_accepted():
    record = parse_local(_local_record(ref_offset=REF_COUNTERS - 1, ref_counter=b"/torch_4242_0_18446744073709551615".hex()),
                         "trainer rank 0")
    assert record.cuda[0].ref_offset == REF_COUNTERS - 1


def test_a_storage_beyond_the_allocation_its_handle_opened_is_refused():
    share = cuda_share(offset=4096, nbytes=2 << 20)
    assert beyond_allocation(share, 0x7000_0000, (0x7000_0000, 4096 + (2 << 20))) is None
    for allocation in [(0x7000_0000, 4096 + (2 << 20) - 1), (0x6FFF_F000, 8 << 20), None]:
        why = beyond_allocation(share, 0x7000_0000, allocation)
        assert why and "\n" not in why, allocation


def test_open_local_refuses_a_share_beyond_its_allocation_before_reading(bf16_plan, rendezvous, monkeypatch, caplog):
    """open_local's wiring, with CUDA IPC faked by a host storage (no GPU here): a share whose offset and size pass the
    allocation the driver reports is not opened, and the trainer is read over NIXL."""
    storage = torch.UntypedStorage(4096)
    monkeypatch.setattr(local_peer, "_device_of", lambda uuid: 0)
    monkeypatch.setattr(CudaShare, "open", lambda share, device: storage)
    monkeypatch.setattr(local_peer, "_allocation", lambda pointer, device: (pointer, 4096))  # offset 4096 + 4096 > 4096

    def tamper(info):
        info["local"]["cuda"] = [dict(cuda_share(nbytes=4096, offset=4096).record(),
                                      ref_counter=f"/torch_{info['local']['pid']}_1_0".encode().hex())]

    assert "does not lie in the allocation of 4096 bytes" in read_over_nixl(bf16_plan, rendezvous, tamper, caplog)


# --- addresses and sizes: range-checked without wrap-around -------------------------------------------------------------

def test_row_lookups_do_not_wrap_around_2_64():
    memory = MemoryMap.of([Span(0x1000, 0x1000, HOST)])
    rows = np.array([[0x1800, (1 << 64) - 0x800], [0x1800, 0x800], [0x2000, 0], [0x2001, 0]], dtype=np.uint64)
    assert memory.locate(rows).tolist() == [-1, 0, 0, -1]
    storages = Storages.of([(0x1000, torch.zeros(0x1000, dtype=torch.uint8))])
    assert storages.locate(rows[:, 0], rows[:, 1]).tolist() == [-1, 0, 0, -1]


WILD = {  # field named in the error -> a change to trainer rank 1's info
    "memory": lambda info: info["memory"].append([(1 << 64) - 4096, 4096, "DRAM", 0]),  # ends at 2**64
    "regions": lambda info: info["regions"][0].__setitem__(2, 1 << 63),  # was an OverflowError (int64 tables)
    "regions[0]": lambda info: info["regions"][0].__setitem__(2, (1 << 63) - 8),
    "local.probe": lambda info: info["local"].__setitem__("probe", [(1 << 64) - 8, 16]),
    "local.cuda[0].bytes": lambda info: info["local"].__setitem__("cuda", [dict(
        cuda_share(address=(1 << 63) - 4096, nbytes=8192).record(), ref_counter=f"/torch_{os.getpid()}_1_0".encode().hex())]),
}


@pytest.mark.parametrize("field", sorted(WILD))
def test_an_address_past_2_63_fails_the_sync_naming_it_and_the_other_trainers_are_told(plan_cache, rendezvous, field):
    """Trainer rank 1 publishes an area reaching past 2**63 (or 2**64): a SyncError naming it and the field, never an
    OverflowError, so trainer rank 0 (connected first) gets `fail` at once instead of waiting out its timeout."""
    plan = load_plan(plan_cache("tiny-glm", "hf", "bf16", "fsdp=2", "tp=1"))
    full = full_weights(plan, 0, 1)
    senders = [Sender(plan, r, shard(plan, full, r), rendezvous=rendezvous, timeout=5, progress="thread").start()
               for r in range(2)]
    receiver = Receiver(plan, 0, plain_destination(plan, 0), rendezvous=rendezvous, timeout=2, derived="caller").start()
    try:
        info = rendezvous.get_json(protocol.trainer_info_key(1))
        WILD[field](info)
        rendezvous.put(protocol.trainer_info_key(1), info)
        for sender in senders:
            sender.publish(1)
        with pytest.raises(SyncError, match=rf"trainer rank 1: its info's '{re.escape(field)}'") as err:
            receiver.sync(1)
        assert "\n" not in str(err.value) and "Overflow" not in str(err.value)
        assert senders[0].release(1, timeout=5).failed == (0,)
    finally:
        receiver.close()
        for sender in senders:
            sender.close()


@pytest.mark.parametrize("device_ipc", ["auto", "off"])
def test_an_unregistered_delta_region_fails_at_connect_naming_it(bf16_plan, rendezvous, device_ipc):
    """Its blobs are read from lists prepared at each delta sync: without this check at connect, NIXL's refusal there
    (nixlNotFoundError) escaped Receiver.sync as no SyncError, and no trainer was told."""
    secret = _secret_bytes(1 << 16)

    def tamper(info):
        info["delta"]["region"] = [secret.data_ptr(), secret.numel()]
        info["memory"].append([secret.data_ptr(), secret.numel(), "DRAM", 0])

    with pair(bf16_plan, rendezvous, tamper, delta=0.5, device_ipc=device_ipc) as (_, _, receiver), \
            pytest.raises(SyncError, match=r"trainer rank 0: its info's 'delta\.region' .*did not register"):
        receiver.sync(1)
