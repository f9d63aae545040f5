"""Strided runs at run time: packing and descriptors against eager torch, table sizes O(stored runs), and
multi-process NIXL syncs of tp=2 MoE plans whose expert down_proj column slices are strided runs."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from benchmarks.synthetic_plans import tp_plan
from weightplan.runtime import Receiver, Rendezvous, Sender, WeightplanError, load_plan
from weightplan.runtime.tables.receiver import descriptor_table
from weightplan.runtime.sender.pack import PackRuns
from weightplan.runtime.tables import ranks
from weightplan.runtime.tables.ranks import (Reads, RemoteRegion, packing, packing_of, pipeline_groups, reads_of,
                                              served_runs)
from weightplan.runtime.tables.ring import DEFAULT_RING_BYTES

from ..conftest import config_dir
from weightplan.testing.runtime_harness import Job
from weightplan.testing.runtime_worker import byte_equal, full_weights, host_reference, plain_destination, shard

PLANS = Path(__file__).resolve().parents[2] / "plans"
_RUN = st.tuples(st.integers(0, 2), st.integers(1, 40), st.integers(1, 12), st.integers(0, 30), st.integers(0, 30),
                 st.integers(0, 200))  # region, row elements, rows, extra source stride, extra destination stride, start


@st.composite
def random_served(draw):
    """Random strided runs over up to three source regions (random shard cuts), each landing in its own destination span."""
    unit = draw(st.sampled_from([1, 2, 4]))
    runs = draw(st.lists(_RUN, min_size=1, max_size=25))
    region, nbytes, count, src_stride, dst_stride, src_byte, dst_byte = ([] for _ in range(7))
    extent, cursor = [0, 0, 0], 0
    for r, n, c, gap_s, gap_d, start in runs:
        stride_s, stride_d = (n + gap_s) * unit, (n + gap_d) * unit
        region.append(r), nbytes.append(n * unit), count.append(c), src_byte.append(start * unit)
        src_stride.append(stride_s if c > 1 else 0), dst_stride.append(stride_d if c > 1 else 0), dst_byte.append(cursor)
        extent[r] = max(extent[r], start * unit + (c - 1) * stride_s + n * unit)
        cursor += (c - 1) * stride_d + n * unit + draw(st.integers(0, 3)) * unit
    col = lambda v: np.array(v, dtype=np.int64)  # noqa: E731
    k = len(runs)
    reads = Reads(run=np.arange(k, dtype=np.int64), region=col(region), src_byte=col(src_byte), dest=np.zeros(k, dtype=np.int64),
                  dst_byte=col(dst_byte), nbytes=col(nbytes), count=col(count), src_stride=col(src_stride), dst_stride=col(dst_stride))
    return reads, extent, cursor


def _eager_rows(buffer: torch.Tensor, start: int, stride: int, nbytes: int, count: int) -> torch.Tensor:
    return torch.cat([buffer[start + i * stride : start + i * stride + nbytes] for i in range(count)])


@settings(max_examples=80, deadline=None)
@given(random_served(), st.integers(0, 400), st.integers(1, 4), st.randoms(use_true_random=False))
def test_packing_and_descriptors_move_every_row_like_eager_torch(case, pack_below, n_groups, rnd):
    reads, extent, dest_bytes = case
    regions = [torch.randint(0, 256, (e,), dtype=torch.uint8) for e in extent]
    with mock.patch.object(ranks, "PACK_BELOW_BYTES", pack_below):
        packing = packing_of(reads)
    packed = torch.zeros(packing.nbytes, dtype=torch.uint8)
    PackRuns(regions, packed, packing, reads)()
    # The packed region holds every packed run's rows back to back, in packing order.
    pos = {int(r): i for i, r in enumerate(reads.run.tolist())}
    for run, at in zip(packing.run.tolist(), packing.packed_byte.tolist()):
        i = pos[run]
        want = _eager_rows(regions[reads.region[i]], int(reads.src_byte[i]), int(reads.src_stride[i]), int(reads.nbytes[i]),
                           int(reads.count[i]))
        assert torch.equal(packed[at : at + want.numel()], want)
    # Executing the receiver's descriptors lands each row where eager indexing puts it.
    group = np.sort(np.array([rnd.randrange(n_groups) for _ in range(len(reads))], dtype=np.int64))
    table = descriptor_table(reads, group, packing.offsets_of(reads.run), reads.dst_byte)
    assert len(table) <= int(reads.count.sum())
    landed, expected = torch.zeros(dest_bytes, dtype=torch.uint8), torch.zeros(dest_bytes, dtype=torch.uint8)
    for region, off, local, n in zip(table.region.tolist(), table.remote_off.tolist(), table.local.tolist(), table.nbytes.tolist()):
        remote = packed if region == RemoteRegion.PACKED else regions[region]
        landed[local : local + n] = remote[off : off + n]
    for i in range(len(reads)):
        for row in range(int(reads.count[i])):
            s, d, n = (int(reads.src_byte[i] + row * reads.src_stride[i]), int(reads.dst_byte[i] + row * reads.dst_stride[i]),
                       int(reads.nbytes[i]))
            expected[d : d + n] = regions[reads.region[i]][s : s + n]
    assert torch.equal(landed, expected)


def test_a_sync_of_1000_rows_per_stored_run_builds_no_table_with_a_row_dimension(tmp_path, rendezvous):
    plan = load_plan(tp_plan(tmp_path / "tp.plan", matrices=4, rows=1000, width=8, row_width=64))
    assert plan.n_runs > 600 * plan.n_stored_runs
    full = full_weights(plan, 0, 1)
    senders = [Sender(plan, r, shard(plan, full, r), rendezvous=rendezvous, timeout=10, verify=True,
                      progress="thread").start() for r in range(2)]
    destinations = [plain_destination(plan, k) for k in range(2)]
    receivers = [Receiver(plan, k, destinations[k], rendezvous=rendezvous, timeout=10, derived="caller", verify=True,
                          group_bytes=64 << 10).start() for k in range(2)]
    try:
        for sender in senders:
            sender.publish(1)
        reports = [receiver.sync(1) for receiver in receivers]
        for k, (receiver, report) in enumerate(zip(receivers, reports)):
            expected = host_reference(plan, full, k)
            assert all(byte_equal(t, destinations[k][n]) for n, t in expected.items())
            stored = sum(len(r) for r in receiver.reads.values())
            rows = sum(int(r.count.sum()) for r in receiver.reads.values())
            # Packed column slices arrive as one descriptor per run, the row-parallel halves in place.
            assert report.descriptors <= stored and report.table_bytes < 8 * rows / 10
            assert report.table_bytes <= 400 * stored, report.table_bytes
            assert report.packed_bytes == sum(e.nbytes for e in plan.dests if k in e.ranks and ".col." in e.name)
        for r, sender in enumerate(senders):
            stats = sender.stats
            served_rows = int(plan.table["count"][plan.table["src_rank"] == r].sum())
            assert stats.table_bytes <= 400 * stats.stored_runs and stats.table_bytes < 8 * served_rows / 10
            assert stats.packed_bytes == sum(e.nbytes for e in plan.dests if ".col." in e.name) // 2
    finally:
        for endpoint in [*receivers, *senders]:
            endpoint.close()


# make test runs the 32 KiB ring, which serves in chunks; the default ring runs in make test-extended
@pytest.mark.parametrize("ring_bytes", [pytest.param(DEFAULT_RING_BYTES, marks=pytest.mark.extended), 32 << 10])
def test_tp2_moe_syncs_over_nixl_match_vllm_load_of_fp32_and_bf16_masters(plan_cache, tmp_path, ring_bytes):
    """tiny-qwen3-moe with tp=2: every expert's down_proj column slice is a strided run read from two FSDP trainers;
    with a 32 KiB ring each trainer serves its 240 KB of packed runs in about 8 chunks."""
    cases = [plan_cache("tiny-qwen3-moe", "stacked", "fp32", "fsdp=2", "tp=2"),
             plan_cache("tiny-qwen3-moe", "hf", "bf16", "fsdp=2", "tp=2")]
    for path in cases:
        plan = load_plan(path)
        strided = plan.table["count"] > 1
        assert any("w2_weight" in plan.dests[d].name for d in plan.table["dest"][strided].tolist())
    names = [f"strided-fp32-{ring_bytes}", f"strided-bf16-{ring_bytes}"]
    model = str(config_dir("tiny-qwen3-moe"))
    with Job(tmp_path, ",".join(map(str, cases)), ",".join(names)) as job:
        for k in range(2):
            job.start(f"inf{k}", "inference", k, "--versions", "1,2", "--model", f"{model},{model}", "--verify",
                      "--timeout", "60", "--ring-bytes", str(ring_bytes))
        for r in range(2):
            job.start(f"tr{r}", "trainer", r, "--versions", "1,2", "--digests", "--wait-joined", "--timeout", "60",
                      "--ring-bytes", str(ring_bytes))
        for name in names:
            for version in (1, 2):
                for k in range(2):
                    e = job.event(f"inf{k}", "synced", version, job=name)
                    assert e["digests"] > 0 and e["n_differ"] == 0, e["differ"]
                    assert e["descriptors"] <= e["stored_runs"] and e["table_bytes"] <= 400 * e["stored_runs"], e
                for r in range(2):
                    released = job.event(f"tr{r}", "released", version, job=name)
                    assert released["timed_out"] == [] and released["failed"] == [] and released["acked"]
                    assert released["table_bytes"] <= 400 * released["stored_runs"], released
                    assert released["packed_bytes"] <= ring_bytes, released  # the ring, not all packed runs
        job.assert_clean_exit()


def test_full_scale_tp8_tables_of_one_trainer_and_one_inference_rank_stay_per_stored_run():
    """The checked-in GLM-5.2 tp=8 plan (about 1900 rows per stored run): tables only, no memory registered."""
    began = time.monotonic()
    plan = load_plan(PLANS / "glm-5.2" / "stacked-bf16-fsdp64-ep8__tp8__none.plan")
    served = served_runs(plan, 0)
    packed = packing_of(served)
    assert served.footprint() + packed.footprint() <= 100 * len(served) < int(served.count.sum())
    reads = reads_of(plan, 0)
    groups = pipeline_groups(reads, 256 << 20)
    stored = sum(len(r) for r in reads.values())
    table_bytes = descriptors = 0
    for src, r in reads.items():
        p = packing(plan, src)
        at = p.offsets_of(r.run)
        table = descriptor_table(r, groups[src], at, r.dst_byte)
        table_bytes += r.footprint() + table.footprint() + p.footprint() + at.nbytes + groups[src].nbytes
        descriptors += len(table)
    assert descriptors <= stored and table_bytes <= 400 * stored
    assert sum(int(r.count.sum()) for r in reads.values()) > 500 * stored
    assert time.monotonic() - began < 60


def _sync_pair_of_pairs(plan, full, ring_bytes: int, version: int = 1):
    """Both trainer ranks and both tp ranks of a tp_plan in this process, each on its own thread (a ring needs
    every reader of a chunk to acknowledge it before the trainer packs the next one)."""
    rendezvous = Rendezvous.connect(f"ring-{uuid.uuid4().hex[:12]}", "127.0.0.1:0", serve=True)
    senders = [Sender(plan, r, shard(plan, full, r), rendezvous=rendezvous, timeout=20, progress="thread",
                      ring_bytes=ring_bytes).start() for r in range(2)]
    destinations = [plain_destination(plan, k) for k in range(2)]
    receivers = [Receiver(plan, k, destinations[k], rendezvous=rendezvous, timeout=20, derived="caller",
                          ring_bytes=ring_bytes).start() for k in range(2)]
    try:
        for sender in senders:
            sender.publish(version)
        with ThreadPoolExecutor(4) as pool:
            released = [pool.submit(sender.release, version) for sender in senders]
            synced = [pool.submit(receiver.sync, version) for receiver in receivers]
            reports = [f.result() for f in synced]
            releases = [f.result() for f in released]
        assert all(r.acked == (0, 1) and not r.timed_out for r in releases)
        return destinations, reports, [sender.stats for sender in senders], [sender.ring for sender in senders]
    finally:
        for endpoint in [*receivers, *senders]:
            endpoint.close()


@pytest.fixture(scope="module")
def ring_case(tmp_path_factory):
    plan = load_plan(tp_plan(tmp_path_factory.mktemp("ring") / "tp.plan", matrices=4, rows=1000, width=8, row_width=64))
    full = full_weights(plan, 0, 1)
    unbounded, _, stats, rings = _sync_pair_of_pairs(plan, full, DEFAULT_RING_BYTES)
    assert rings == [None, None]
    assert [s.packed_bytes for s in stats] == [_PACKED_BYTES] * 2  # a ring this large or larger holds it all: no ring
    return plan, full, unbounded, stats


_PACKED_BYTES = 128_000  # each trainer rank's packed region in ring_case (4 column-split matrices, 16000-byte runs)


@settings(max_examples=6, deadline=None)
@given(st.integers(16_000, _PACKED_BYTES - 1))
@example(16_000)  # one run per chunk
@example(_PACKED_BYTES - 1)  # the largest ring that still cuts (128000, drawn once, is no ring at all)
def test_ring_buffered_serving_equals_unbounded_serving_byte_for_byte(ring_case, ring_bytes):
    plan, full, unbounded, unbounded_stats = ring_case
    destinations, reports, stats, rings = _sync_pair_of_pairs(plan, full, ring_bytes)
    for k in range(2):
        assert all(byte_equal(t, unbounded[k][n]) for n, t in destinations[k].items())
    for ring, s, u in zip(rings, stats, unbounded_stats):
        assert ring is not None and len(ring) >= 2 and s.packed_bytes == ring.slot_bytes <= ring_bytes < u.packed_bytes
    assert reports[0].packed_bytes == sum(e.nbytes for e in plan.dests if 0 in e.ranks and ".col." in e.name)


def test_a_ring_smaller_than_one_packed_run_is_refused_in_one_line(ring_case, rendezvous):
    plan, full, _, _ = ring_case
    with pytest.raises(WeightplanError, match=r"^trainer rank 0: a packed run of 16000 bytes does not fit a ring of "
                                              r"1000 bytes; raise ring_bytes$"):
        Sender(plan, 0, shard(plan, full, 0), rendezvous=rendezvous, ring_bytes=1000)
    with pytest.raises(WeightplanError, match=r"^inference rank 1: a packed run"):
        Receiver(plan, 1, plain_destination(plan, 1), rendezvous=rendezvous, derived="caller", ring_bytes=1000)
