"""Node-local fan-out (`--inference ...,gpus-per-node=G`): the holder choice, the plan table, the host executor and
verify-plan against vLLM, and real processes over NIXL (4 inference ranks on 2 "nodes"), a puller killed mid-sync."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightplan.compiler.ir import Program
from weightplan.compiler.passes.place_fanout import place_fanout
from weightplan.compiler.verify_plan import verify_plan
from weightplan.runtime import load_plan
from weightplan.runtime.errors import PlanFormatError
from weightplan.runtime.plan.columns import Runs
from weightplan.runtime.plan.format import Plan
from weightplan.runtime.plan.header import InferenceHeader, PlanHeader, TrainerHeader
from weightplan.runtime.plan.invariants import fanout_problem
from weightplan.runtime.plan.schema import TensorEntry
from weightplan.runtime.tables.fanout import second_hops, served_hops

from ..conftest import config_dir, with_header_edit
from weightplan.testing.runtime_harness import Job

BF16 = ("tiny-qwen3-moe", "transformers", "bf16", "fsdp=2", "dp=4,ep,gpus-per-node=2")
FP8 = ("fp8-deepseek-v3", "transformers", "bf16", "fsdp=2", "dp=4,ep,gpus-per-node=2", "fp8_per_block")


@st.composite
def replicated_dests(draw):
    """Destination entries held by random rank sets of a random world, and a node size."""
    world = draw(st.integers(1, 12))
    entries = []
    for i in range(draw(st.integers(1, 10))):
        ranks = draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True))
        entries.append(TensorEntry(f"t{i}", (draw(st.integers(1, 64)),), "bfloat16", ranks=tuple(sorted(ranks))))
    return tuple(entries), world, draw(st.integers(2, 6))


@settings(max_examples=200, deadline=None)
@given(replicated_dests())
def test_every_holder_gets_each_byte_once_and_second_hops_read_only_pullers(case):
    dests, world, gpus_per_node = case
    fanout = place_fanout(Program((), dests, gpus_per_node=gpus_per_node)).fanout
    assert fanout_problem(dests, [], fanout) == ""
    header = PlanHeader(vllm_version="test", model="fanout", config_sha256="", architecture="none",
                        trainer=TrainerHeader("hf", "bf16", "fsdp1", ()), inference=InferenceHeader(f"tp{world}", world, 1, False, "cpu"),
                        quant="none", src_ranks=1, dst_ranks=world, sources=(), dests=dests, cast_chains=(), fanout=fanout)
    plan = Plan(header, Runs.empty())
    pullers = fanout.pullers()
    for rank in range(world):
        hops = second_hops(plan, rank)
        from_peers = [d for ds in hops.values() for d in ds]
        assert len(from_peers) == len(set(from_peers))
        for d, entry in enumerate(dests):
            if rank not in entry.ranks:
                assert d not in from_peers
                continue
            pulls = rank in pullers.get(d, entry.ranks)
            assert pulls != (d in from_peers), "each held entry arrives exactly once: pulled, or read from a peer"
        for puller, ds in hops.items():
            assert puller // gpus_per_node == rank // gpus_per_node and puller != rank
            assert all(puller in pullers[d] for d in ds), "a second hop reads only what its source pulled itself"
            assert set(ds) <= set(served_hops(plan, puller)[rank])
    for d, entry in enumerate(dests):  # pulled from the trainers once per node holding it
        nodes = {r // gpus_per_node for r in entry.ranks}
        assert len(pullers[d]) == len(nodes) if d in pullers else len(entry.ranks) == len(nodes)


def test_pullers_share_a_node_s_replicated_bytes_evenly():
    dests = tuple(TensorEntry(f"t{i}", (100,), "bfloat16", ranks=tuple(range(8))) for i in range(16))
    fanout = place_fanout(Program((), dests, gpus_per_node=4)).fanout
    pulled = np.zeros(8, dtype=int)
    for _, ranks in fanout.first_hops:
        pulled[list(ranks)] += 1
    assert pulled.tolist() == [4] * 8


def _rewrite(path, tmp_path, change) -> str:
    """The plan at `path` with its header changed by `change(header)` (valid digest and fingerprint)."""
    out = tmp_path / "changed.plan"
    out.write_bytes(with_header_edit(path.read_bytes(), change))
    return str(out)


def _a_node_without_puller(header):
    del header["fanout"]["first_hops"][0][1][0]


def _two_pullers_on_one_node(header):
    dest, pullers = header["fanout"]["first_hops"][0]
    header["fanout"]["first_hops"][0][1] = sorted(set(header["dests"][dest][3]) - {max(header["dests"][dest][3])})


BAD_TABLES = {
    "not a holder": (lambda h: h["fanout"]["first_hops"][0][1].__setitem__(0, 99), "not increasing ranks"),
    "node without puller": (_a_node_without_puller, "not one per node"),
    "two on a node": (_two_pullers_on_one_node, "not one per node"),
    "every holder": (lambda h: h["fanout"]["first_hops"][0].__setitem__(1, h["dests"][h["fanout"]["first_hops"][0][0]][3]),
                     "not one per node"),
    "no node size": (lambda h: h["fanout"].pop("gpus_per_node"), "'fanout.gpus_per_node' is missing"),
    "bad entry": (lambda h: h["fanout"]["first_hops"][0].__setitem__(0, 10**6), "first_hops[0]"),
}


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_a_malformed_fanout_table_is_refused_in_one_line(plan_cache, tmp_path, case):
    change, message = BAD_TABLES[case]
    path = _rewrite(plan_cache(*BF16), tmp_path, change)
    with pytest.raises(PlanFormatError, match=re.escape(message)) as err:
        load_plan(path)
    assert "\n" not in str(err.value)


def test_fp8_weight_and_scale_with_different_pullers_are_refused(plan_cache, tmp_path):
    def split(header):
        weight, scale = header["staging"][0][4:6]
        hops = dict((d, p) for d, p in header["fanout"]["first_hops"])
        other = [r for r in header["dests"][scale][3] if r not in hops[scale] and r // 2 == hops[scale][0] // 2][0]
        row = next(row for row in header["fanout"]["first_hops"] if row[0] == scale)
        row[1] = sorted([other, *hops[scale][1:]])

    with pytest.raises(PlanFormatError, match="different pullers"):
        load_plan(_rewrite(plan_cache(*FP8), tmp_path, split))


@pytest.mark.parametrize("case", [BF16, FP8], ids=["bf16", "fp8"])
def test_fanout_plan_matches_vllm_on_every_rank(plan_cache, case):
    path = plan_cache(*case)
    plan = load_plan(path)
    assert plan.header.format_version == 6 and plan.fanout.gpus_per_node == 2
    assert any(second_hops(plan, r) for r in range(4))
    result = verify_plan(path, model=str(config_dir(case[0])), seed=3)
    assert result.tensors > 0 and result.mismatches == ()


def test_verify_plan_fails_when_second_hops_are_skipped(plan_cache, monkeypatch):
    """The check above can fail: without the second hops, the peers' replicated entries stay poisoned."""
    from weightplan.runtime.host import executor

    monkeypatch.setattr(executor, "second_hops", lambda plan, rank: {})
    result = verify_plan(plan_cache(*BF16), model=str(config_dir(BF16[0])), seed=3)
    assert result.mismatches and all("inference rank" in m for m in result.mismatches)


TIMEOUT = 10.0


def _synced(job: Job, key: str, version: int) -> dict:
    e = job.event(key, "synced", version)
    assert e["reported"] == version and e["n_differ"] == 0, e
    return e


@pytest.mark.extended
def test_four_inference_processes_on_two_nodes_sync_bf16_and_fp8_over_nixl(plan_cache, tmp_path):
    plans = [plan_cache(*BF16), plan_cache(*FP8)]
    models = ",".join(str(config_dir(case[0])) for case in (BF16, FP8))
    names = ",".join(str(p) for p in plans)
    with Job(tmp_path, names, "fanout-bf16,fanout-fp8") as job:
        for k in range(4):
            job.start(f"inf{k}", "inference", k, "--versions", "1,2", "--model", models, "--verify", "--timeout", "120")
        for r in range(2):
            job.start(f"tr{r}", "trainer", r, "--versions", "1,2", "--digests", "--wait-joined", "--timeout", "120")
        job.assert_fanout_syncs(dict(zip(("fanout-bf16", "fanout-fp8"), plans)), (1, 2), readers=4, trainers=2)
        job.assert_clean_exit()


def test_a_puller_killed_mid_sync_fails_its_node_peer_then_its_restart_restores_the_next_sync(plan_cache, tmp_path):
    path = plan_cache(*BF16)
    plan = load_plan(path)
    victim = next(iter(second_hops(plan, 0)))  # rank 0's puller on node 0
    with Job(tmp_path, path, "fanout-dies") as job:
        for r in range(2):
            job.start(f"tr{r}", "trainer", r, "--versions", "1,2,3", "--gate", "--timeout", str(TIMEOUT))
        for k in range(4):
            hold = ("--hold-at", "2") if k == victim else ()
            job.start(f"inf{k}", "inference", k, "--plain", "--gate", "--versions", "1,2,3", "--timeout", str(TIMEOUT), *hold)
            job.event(f"inf{k}", "joined")
        job.go(1)
        for k in range(4):
            _synced(job, f"inf{k}", 1)
        job.go(2)
        job.event(f"inf{victim}", "mid-sync", 2)  # its first hop has not landed
        job.kill(f"inf{victim}")
        failed = job.event("inf0", "failed", 2)
        assert failed["reported"] is None and f"inference rank {victim}" in failed["error"], failed
        for k in (2, 3):  # the other node does not depend on it
            _synced(job, f"inf{k}", 2)
        job.start("restarted", "inference", victim, "--plain", "--gate", "--versions", "3", "--timeout", str(TIMEOUT))
        job.event("restarted", "joined")
        job.go(3)
        for key in ("inf0", "restarted", "inf2", "inf3"):
            e = _synced(job, key, 3)
            assert e["tensors"] > 0
        job.assert_clean_exit("tr0", "tr1", "inf0", "restarted", "inf2", "inf3")
