"""Same-host reads without NIXL (runtime/transport/local_peer.py): process_vm_readv between real processes, the fallback
to NIXL, the published record's checks, and the seam both readers implement."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightplan.runtime import Receiver, SyncError, WeightplanError
from weightplan.runtime.transport.local_peer import LocalReader
from weightplan.runtime.transport.local_record import HostId, LocalRecord, parse_local
from weightplan.runtime.transport.nixl_agent import NixlAgent
from weightplan.runtime.transport.reader import PeerReader, Routed
from weightplan.runtime.transport.vm_read import batches

from weightplan.testing.runtime_harness import Job
from weightplan.testing.runtime_worker import plain_destination

from ..support.local_reads import (  # noqa: F401 (fixtures)
    SECRET, bf16_plan, cuda_share, equal_to_host, pair, read_over_nixl, rendezvous,
)


@pytest.mark.parametrize("device_ipc,path", [("auto", "process_vm_readv"), ("off", "nixl")])
def test_a_trainer_on_this_host_is_read_by_the_path_device_ipc_allows(bf16_plan, rendezvous, device_ipc, path):
    with pair(bf16_plan, rendezvous, device_ipc=device_ipc) as (sender, destination, receiver):
        report = receiver.sync(1)
        assert report.paths == {path: report.bytes} and report.bytes == sum(e.nbytes for e in bf16_plan.dests)
        equal_to_host(bf16_plan, destination)
        assert isinstance(receiver.connections.trainers.by_rank[0].peer.reader, LocalReader if device_ipc == "auto" else NixlAgent)
        assert sender.release(1, timeout=5).acked == (0,)  # acks still go over NIXL


def test_a_delta_sync_reads_its_delta_directly_too(bf16_plan, rendezvous):
    with pair(bf16_plan, rendezvous, delta=0.5) as (sender, destination, receiver):
        full = receiver.sync(1)
        sender.release(1, timeout=5)
        for source in sender._sources:
            source.view(-1)[:1] += 1  # one changed element per served region: an optimizer step that touches little
        sender.publish(2)
        report = receiver.sync(2)
        assert full.took == "full" and report.took == "delta" and 0 < report.delta_bytes < full.bytes
        assert full.paths == {"process_vm_readv": full.bytes} and report.paths == {"process_vm_readv": report.bytes}
        assert report.bytes < full.bytes


@pytest.mark.parametrize("failure", ["another host", "a pid that is not the trainer", "a probe elsewhere",
                                     "a GPU span without a handle"])
def test_a_trainer_that_cannot_be_opened_is_read_over_nixl_with_the_same_bytes(bf16_plan, rendezvous, caplog, failure):
    def tamper(info):
        local = info["local"]
        if failure == "another host":
            local["host"]["hostname"] = "elsewhere"
        elif failure == "a pid that is not the trainer":
            local["pid"] = 1  # init: not permitted, or not holding the incarnation
        elif failure == "a probe elsewhere":
            local["probe"][0] = info["seq"]
        else:  # claims one more device span, which NIXL too would refuse: use a region the receiver never reads
            local["cuda"] = []
            info["memory"].append([1 << 40, 4096, "VRAM", 0])

    read_over_nixl(bf16_plan, rendezvous, tamper, caplog)


BAD_RECORDS = {
    "local": lambda local: ["not", "an", "object"],
    "local.pid": lambda local: dict(local, pid=0),
    "local.probe": lambda local: dict(local, probe=[local["probe"][0], 4096]),
    "local.host.boot_id": lambda local: dict(local, host=dict(local["host"], boot_id="../../etc/passwd")),
    "local.cuda": lambda local: dict(local, cuda=[{}] * (1 << 16 | 1)),
    "local.cuda[0]": lambda local: dict(local, cuda=[{"address": 1}]),
    "local.cuda[0].handle": lambda local: dict(local, cuda=[dict(cuda_share().record(), handle="ab" * 4096)]),
    "local.cuda[0].bytes": lambda local: dict(local, cuda=[dict(cuda_share().record(), bytes=1 << 64)]),
    "local.cuda[0].event_sync": lambda local: dict(local, cuda=[dict(cuda_share().record(), event_sync="yes")]),
}


@pytest.mark.parametrize("field", sorted(BAD_RECORDS))
def test_a_malformed_or_oversized_local_record_fails_the_sync_naming_the_field(bf16_plan, rendezvous, field):
    def tamper(info):
        info["local"] = BAD_RECORDS[field](info["local"])

    with pair(bf16_plan, rendezvous, tamper) as (_, _, receiver), \
            pytest.raises(SyncError, match=rf"trainer rank 0: its info's '{re.escape(field)}'") as err:
        receiver.sync(1)
    assert "\n" not in str(err.value) and receiver.version is None


def test_device_ipc_takes_auto_or_off_only(bf16_plan, no_agents):
    with pytest.raises(WeightplanError, match="inference rank 0: device_ipc must be one of auto, off, not 'on'"):
        Receiver(bf16_plan, 0, plain_destination(bf16_plan, 0), rendezvous=None, derived="caller", device_ipc="on")


@pytest.mark.parametrize("share", [cuda_share(), cuda_share(event=b"", event_sync=False, offset=0, device=0)])
def test_the_cuda_share_record_round_trips_through_json(share):
    record = LocalRecord(HostId("0c6d3ab4-3f6e-4b1a-9d55-0b9a1d7e4c21", "node-7.cluster"), 4242, 0x5555_0000, (share,))
    assert parse_local(json.loads(json.dumps(record.record())), "trainer rank 0") == record
    assert parse_local(None, "trainer rank 0") is None


@given(st.lists(st.integers(0, 5 << 10), max_size=300), st.integers(1, 7), st.integers(1, 4 << 10))
def test_iovec_batches_cover_every_row_once_within_the_limits(sizes, max_iov, max_bytes):
    nbytes = np.array(sizes, dtype=np.uint64)
    local = np.cumsum(np.concatenate([[1 << 20], nbytes[:-1] + 8])).astype(np.uint64) if sizes else nbytes
    remote = local + np.uint64(1 << 32)
    plan = batches(local, remote, nbytes, max_iov, max_bytes)
    counts, sums = np.diff(plan.bounds), np.add.reduceat(plan.nbytes, plan.bounds[:-1]) if len(plan.nbytes) else []
    assert plan.bounds[0] == 0 and plan.bounds[-1] == len(plan.nbytes) and (counts > 0).all() and (counts <= max_iov).all()
    assert all(s <= max_bytes for s in sums) and (plan.nbytes > 0).all()
    assert (plan.remote - plan.local == np.uint64(1 << 32)).all()
    covered = sorted(zip(plan.local.tolist(), (plan.local + plan.nbytes).tolist()))
    wanted = [(a, a + n) for a, n in zip(local.tolist(), nbytes.tolist()) if n]
    merged = []  # pieces of one row, in order, end to end
    for lo, hi in covered:
        if merged and merged[-1][1] == lo and not any(w[0] == lo for w in wanted):
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    assert merged == wanted


def test_both_readers_and_the_router_declare_the_seam():
    for reader in (NixlAgent, LocalReader, Routed):
        assert issubclass(reader, PeerReader), reader


def test_syncs_between_processes_move_every_byte_directly_and_equal_nixl_and_the_host_executor(plan_cache, tmp_path,
                                                                                              monkeypatch):
    """One trainer and one inference process of a job with a secret, three cases one after the other: a bf16 plan read
    directly, the same over NIXL (device_ipc="off"), an fp8 plan read directly; each checked against the host executor
    in the worker."""
    monkeypatch.setenv("WEIGHTPLAN_SECRET", SECRET)  # the store here and the workers (they inherit the environment)
    bf16 = plan_cache("tiny-glm", "hf", "bf16", "fsdp=1", "tp=1")
    fp8 = plan_cache("fp8-glm", "hf", "bf16", "fsdp=1", "tp=1", quant="fp8_per_block")
    plans, jobs = f"{bf16},{bf16},{fp8}", "local-bf16,nixl-bf16,local-fp8"
    with Job(tmp_path, plans, jobs) as job:
        job.start("inf0", "inference", 0, "--plain", "--versions", "1,2", "--device-ipc", "auto,off,auto", "--timeout", "60")
        job.start("tr0", "trainer", 0, "--versions", "1,2", "--wait-joined", "--timeout", "60")
        synced = {case: [job.event("inf0", "synced", v, job=case) for v in (1, 2)] for case in jobs.split(",")}
        for case, events in synced.items():
            path = "nixl" if case.startswith("nixl") else "process_vm_readv"
            for e in events:
                assert e["n_differ"] == 0 and e["paths"] == {path: e["bytes"]} and e["bytes"] > 0, (case, e)
        assert [e["sha256"] for e in synced["local-bf16"]] == [e["sha256"] for e in synced["nixl-bf16"]]
        job.assert_clean_exit()
