"""Per-rank tables of a plan: what each trainer rank serves and what each inference rank reads."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightplan.runtime import PlanMismatchError, load_plan
from weightplan.runtime.tables.ranks import Reads, pipeline_groups, reads_of, readers, served_regions, served_runs


@pytest.fixture(scope="module")
def plan(plan_cache):
    return load_plan(plan_cache("tiny-glm", "stacked", "bf16", "fsdp=4,ep=2", "dp=4,ep"))


def test_reads_of_all_inference_ranks_are_the_plan_runs_times_their_holders(plan):
    total = sum(len(r) for k in range(plan.header.dst_ranks) for r in reads_of(plan, k).values())
    assert total == sum(len(plan.dests[d].ranks) for d in plan.table["dest"].tolist())
    nbytes = sum(int(r.total().sum()) for k in range(plan.header.dst_ranks) for r in reads_of(plan, k).values())
    assert nbytes == sum(e.nbytes * len(e.ranks) for e in plan.dests)


def test_reads_stay_inside_the_served_regions_and_destinations(plan):
    for k in range(plan.header.dst_ranks):
        for src, reads in reads_of(plan, k).items():
            regions = served_regions(plan, src)
            limit = np.array([r.nbytes for r in regions])[reads.region]
            last = reads.count - 1
            assert (reads.src_byte >= 0).all() and (reads.src_byte + last * reads.src_stride + reads.nbytes <= limit).all()
            assert (reads.dst_byte + last * reads.dst_stride + reads.nbytes
                    <= np.array([plan.dests[d].nbytes for d in reads.dest])).all()
            assert all(k in plan.dests[d].ranks for d in set(reads.dest.tolist()))


def test_readers_and_served_runs_agree(plan):
    for r in range(plan.header.src_ranks):
        served = served_runs(plan, r)
        assert len(served) == int((plan.table["src_rank"] == r).sum())
        assert set(readers(plan, r)) == {k for d in served.dest.tolist() for k in plan.dests[d].ranks}


def test_ranks_outside_the_plan_are_refused(plan):
    with pytest.raises(PlanMismatchError, match="trainer rank 4 is not in the plan's 4 trainer ranks"):
        served_regions(plan, 4)
    with pytest.raises(PlanMismatchError, match="inference rank -1 is not in the plan's 4 inference ranks"):
        reads_of(plan, -1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 5000)), min_size=1, max_size=30), min_size=1, max_size=3),
       st.integers(1, 20000))
def test_pipeline_groups_follow_entry_order_and_keep_entries_whole(tables, group_bytes):
    reads = {}
    for src, rows in enumerate(tables):
        dest = np.array([d for d, _ in rows], dtype=np.int64)
        n = np.array([b for _, b in rows], dtype=np.int64)
        zeros = np.zeros(len(rows), dtype=np.int64)
        reads[src] = Reads(zeros, zeros, zeros, dest, zeros, n, np.ones(len(rows), dtype=np.int64), zeros, zeros)
    groups = pipeline_groups(reads, group_bytes)
    group_of: dict[int, int] = {}
    for src, r in reads.items():
        for d, g in zip(r.dest.tolist(), groups[src].tolist()):
            assert group_of.setdefault(d, g) == g, "an entry is split across groups"
    order = sorted(group_of)
    assert [group_of[d] for d in order] == sorted(group_of[d] for d in order), "groups follow entry order"
    assert sorted(set(group_of.values())) == list(range(len(set(group_of.values())))), "groups are numbered densely"
    per_entry = {d: sum(int(r.nbytes[r.dest == d].sum()) for r in reads.values()) for d in order}
    for g in set(group_of.values()):
        members = [d for d in order if group_of[d] == g]
        # A group closes once it holds group_bytes: only its last entry may carry it past the bound.
        assert sum(per_entry[d] for d in members[:-1]) < group_bytes
