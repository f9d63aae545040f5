"""EPLB plans over NIXL: each inference rank's expert slots hold, after every sync, the logical expert that the engine's
current physical-to-logical table (vLLM's own balancer's) puts there; the mapping's refusals.

The plan (tests/runtime/data/, compiled by vLLM's CUDA build for `dp=2,ep,eplb=2`; tests/cuda/test_cuda_eplb.py
recompiles it and proves it equals vLLM's own load) writes vLLM's initial arrangement. Its host execution is that
arrangement's bytes; any later table's bytes follow from it: slot s holds what the first slot that initially held the
same logical expert holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from weightplan.runtime import PlanFormatError, PlanMismatchError, Receiver, Sender, WeightplanError, load_plan
from weightplan.runtime.plan.format import decode_plan
from weightplan.runtime.tables.eplb import eplb_reads, initial_arrangement
from weightplan.runtime.tables.ranks import reads_of, readers
from weightplan.testing.eplb import eplb_reference, initial_table, vllm_rebalanced
from weightplan.testing.runtime_worker import byte_equal, full_weights, host_reference, plain_destination, shard

from ..conftest import with_header_edit

PLAN = Path(__file__).parent / "data" / "tiny-qwen3-moe-eplb2.plan"


@pytest.fixture(scope="module")
def plan():
    return load_plan(PLAN)


def test_the_plan_writes_vllms_initial_arrangement_with_equal_replicas(plan):
    """Every physical slot of the initial arrangement holds its logical expert: replicas of one expert are equal bytes."""
    eplb = plan.header.inference.eplb
    assert (eplb.logical_experts, eplb.redundant_experts, len(eplb.layers)) == (8, 2, 4)
    full = full_weights(plan, 0, 1)
    initial = {r: host_reference(plan, full, r) for r in range(plan.header.dst_ranks)}
    local = eplb.physical_experts // plan.header.dst_ranks
    arrangement = initial_arrangement(eplb)
    for names in eplb.layers:
        for name in names:
            slots = {}
            for slot, expert in enumerate(arrangement.tolist()):
                rank, at = divmod(slot, local)
                slots.setdefault(expert, []).append(initial[rank][name][at])
            assert all(byte_equal(copy, copies[0]) for copies in slots.values() for copy in copies[1:])
            assert not any(byte_equal(slots[0][0], slots[e][0]) for e in range(1, eplb.logical_experts))


def _senders(plan, rendezvous, version: int):
    full = full_weights(plan, 0, version)
    return full, [Sender(plan, r, shard(plan, full, r), rendezvous=rendezvous, timeout=10, progress="thread").start()
                  for r in range(plan.header.src_ranks)]


def _receivers(plan, rendezvous, table):
    destinations = [plain_destination(plan, r) for r in range(plan.header.dst_ranks)]
    receivers = [Receiver(plan, r, destinations[r], rendezvous=rendezvous, timeout=10, derived="caller",
                          expert_map=table).start() for r in range(plan.header.dst_ranks)]
    return destinations, receivers


def test_syncs_follow_vllms_rearrangements_without_restarting_the_trainers(plan, rendezvous):
    """Version 1 on the initial table, then vLLM's balancer rearranges (two of its tables) and each engine rank makes a
    new Receiver on the new table, as the vLLM backend does; the trainers keep running."""
    tables = [initial_table(plan), vllm_rebalanced(plan, 1), vllm_rebalanced(plan, 2)]
    assert not np.array_equal(tables[1], tables[0]) and not np.array_equal(tables[2], tables[1])
    senders = []
    try:
        for version, table in enumerate(tables, start=1):
            for sender in senders:
                sender.close()
            full, senders = _senders(plan, rendezvous, version)
            destinations, receivers = _receivers(plan, rendezvous, table)
            try:
                for sender in senders:
                    sender.publish(version)
                for receiver in receivers:
                    receiver.sync(version)
            finally:
                for receiver in receivers:
                    receiver.close()
            for rank in range(plan.header.dst_ranks):
                tensors = eplb_reference(plan, full, rank, table)
                bad = [n for n, t in tensors.items() if not byte_equal(t, destinations[rank][n])]
                assert not bad, f"version {version}, rank {rank}: {bad[:3]}"
    finally:
        for sender in senders:
            sender.close()


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_mapped_reads_write_every_expert_byte_once_from_that_experts_runs(plan, data):
    """For any table (any expert in any slot, replicas anywhere), a rank's reads write each byte of its expert tensors
    exactly once, each slot from the runs the plan has for its logical expert; the other reads are the plan's."""
    eplb = plan.header.inference.eplb
    shape = (len(eplb.layers), eplb.physical_experts)
    table = np.array(data.draw(st.lists(st.integers(0, eplb.logical_experts - 1), min_size=shape[0] * shape[1],
                                        max_size=shape[0] * shape[1])), dtype=np.int64).reshape(shape)
    rank = data.draw(st.integers(0, plan.header.dst_ranks - 1))
    local = eplb.physical_experts // plan.header.dst_ranks
    names = {n for layer in eplb.layers for n in layer}
    mapped, plain = eplb_reads(plan, rank, table), reads_of(plan, rank)

    def others(reads):
        keep = np.array([plan.dests[d].name not in names for d in reads.dest.tolist()], dtype=bool)
        return reads.take(np.flatnonzero(keep)).columns()

    for src in set(mapped) | set(plain):
        ours, theirs = (others(r) if r is not None else None for r in (mapped.get(src), plain.get(src)))
        if ours is None or theirs is None:
            assert all(len(c) == 0 for c in (ours or theirs).values())
        else:
            assert all(np.array_equal(ours[k], theirs[k]) for k in theirs)
    for layer, layer_names in enumerate(eplb.layers):
        for name in layer_names:
            entry = next(i for i, e in enumerate(plan.dests) if e.name == name and rank in e.ranks)
            size = plan.dests[entry].nbytes
            slot_bytes = size // local
            written = np.zeros(size, dtype=np.int64)
            runs_by_slot: dict[int, set] = {}
            for reads in mapped.values():
                rows = reads.take(np.flatnonzero(reads.dest == entry))
                for k in range(len(rows)):
                    for i in range(int(rows.count[k])):
                        start = int(rows.dst_byte[k] + i * rows.dst_stride[k])
                        written[start:start + int(rows.nbytes[k])] += 1
                    runs_by_slot.setdefault(int(rows.dst_byte[k]) // slot_bytes, set()).add(int(rows.run[k]))
            assert np.all(written == 1), f"{name}: bytes written {set(written.tolist())} times"
            for s, runs in runs_by_slot.items():
                expert = int(table[layer, rank * local + s])
                same = [t for t in range(local) if int(table[layer, rank * local + t]) == expert]
                assert all(runs_by_slot[t] == runs for t in same)


def test_every_inference_rank_reads_every_trainer_serving_experts(plan):
    """Any rank's slot may come to hold any expert: the trainers wait for every rank's acknowledgement."""
    assert all(readers(plan, r) == tuple(range(plan.header.dst_ranks)) for r in range(plan.header.src_ranks))


@pytest.mark.parametrize("table, message", [
    (None, r"is for an engine with EPLB: pass expert_map"),
    (np.zeros((4, 9), dtype=np.int64), r"the expert map is int64\[4, 9\]; the plan needs integer \[4 MoE layers, 10 "
                                       r"physical slots\] \(8 logical \+ 2 redundant experts\)"),
    (np.full((4, 10), 8, dtype=np.int64), r"puts expert 8 in slot 0 of MoE layer 0; the plan has experts 0..7"),
    (np.full((4, 10), -1, dtype=np.int64), r"puts expert -1 in slot 0 of MoE layer 0"),
    (np.zeros((4, 10), dtype=np.float32), r"the expert map is float32\[4, 10\]"),
])
def test_a_missing_or_wrong_expert_map_is_refused_in_one_line(plan, rendezvous, table, message):
    with pytest.raises(PlanMismatchError, match=message) as caught:
        Receiver(plan, 0, plain_destination(plan, 0), rendezvous=rendezvous, derived="caller", expert_map=table)
    assert "\n" not in str(caught.value)


def test_what_eplb_does_not_support_yet_is_refused_naming_it(plan, rendezvous):
    table = initial_table(plan)
    with pytest.raises(WeightplanError, match=r"inference rank 0: EPLB plans do not support verify=True, delta yet"):
        Receiver(plan, 0, plain_destination(plan, 0), rendezvous=rendezvous, derived="caller", expert_map=table,
                 verify=True, delta=0.5)


def test_an_expert_map_for_a_plan_without_eplb_is_refused(plan_cache, rendezvous):
    other = load_plan(plan_cache("tiny-glm", "hf", "bf16", "fsdp=1", "tp=1"))
    with pytest.raises(PlanMismatchError, match=r"expert_map is given, but plan .* was not compiled for EPLB"):
        Receiver(other, 0, plain_destination(other, 0), rendezvous=rendezvous, derived="caller",
                 expert_map=np.zeros((1, 1), dtype=np.int64))


def _edited(edit):
    def change(header):
        edit(header["inference"])
    return decode_plan(with_header_edit(PLAN.read_bytes(), change))


@pytest.mark.parametrize("edit, message", [
    (lambda i: i["eplb"]["layers"][0].append("model.embed_tokens.weight"),
     r"'inference.eplb.layers' names 'model.embed_tokens.weight', whose dim 0 is not the 5 local slots"),
    (lambda i: i["eplb"]["layers"][0].append("no.such.tensor"),
     r"'inference.eplb.layers' names 'no.such.tensor', which is not a destination of every inference rank"),
    (lambda i: i["eplb"].update(redundant_experts=3),
     r"'inference.eplb' has 11 physical experts, which the 2 ranks do not split evenly"),
    (lambda i: i["eplb"].update(redundant_experts=4),
     r"'inference.eplb.layers' names '.*w13_weight', whose dim 0 is not the 6 local slots"),
    (lambda i: i.update(ep=False), r"'inference.eplb' needs expert parallelism over one pipeline stage"),
    (lambda i: i["eplb"].update(slots=3), r"'inference.eplb.slots' is unknown"),
    (lambda i: i["eplb"].update(layers=[]), r"'inference.eplb.layers' is not a list of MoE layers"),
    (lambda i: i["eplb"]["layers"].append(i["eplb"]["layers"][0]), r"'inference.eplb.layers' names a destination in two"),
])
def test_a_plan_whose_eplb_record_contradicts_its_tables_is_refused_naming_the_field(edit, message):
    with pytest.raises(PlanFormatError, match=message) as caught:
        _edited(edit)
    assert "\n" not in str(caught.value)


def test_a_plan_whose_runs_cross_expert_slots_is_refused(plan_cache, rendezvous):
    """A dp=2,ep plan compiled without eplb (the stacked trainer's neighbouring experts coalesced into one run), its
    header claiming EPLB: mapping slot by slot would tear those runs, so the receiver refuses it in one line."""
    path = plan_cache("tiny-qwen3-moe", "stacked", "bf16", "fsdp=2", "dp=2,ep")

    def claim_eplb(header):
        inference = header["inference"]
        inference["eplb"] = {"logical_experts": 8, "redundant_experts": 0, "layers": [
            [f"model.layers.{i}.mlp.experts.routed_experts.{w}_weight" for w in ("w13", "w2")] for i in range(4)]}

    claimed = decode_plan(with_header_edit(path.read_bytes(), claim_eplb))
    crossing = r"a run into 'model\.layers\.\d\.mlp\.experts\.routed_experts\.w\d+_weight' crosses an expert slot"
    with pytest.raises(PlanMismatchError, match=crossing + "; recompile it") as caught:
        Receiver(claimed, 0, plain_destination(claimed, 0), rendezvous=rendezvous, derived="caller",
                 expert_map=initial_table(claimed))
    assert "\n" not in str(caught.value)
