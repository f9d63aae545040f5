"""simulate-plan: hand-computable sync times, bad cluster files, and the HTML report's SVG."""

from __future__ import annotations

import json
from pathlib import Path
from html.parser import HTMLParser

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightplan.compiler.cli import inspect_main, simulate_main
from weightplan.compiler.ir import PlanOrigin, Program, Runs, TensorEntry
from weightplan.compiler.plan_summary import per_rank_bytes, stage_pair_bytes
from weightplan.compiler.plan_writer import write_program
from weightplan.compiler.simulate.cluster import ClusterError, parse_cluster
from weightplan.compiler.simulate.fair_share import Resource, Task, simulate
from weightplan.compiler.simulate.model import predict
from weightplan.compiler.simulate.report import resolve_cluster
from weightplan.compiler.simulate.transfers import PlanTransfers, plan_transfers
from weightplan.runtime import load_plan
from weightplan.runtime.layout.shards import TrainerLayout
from weightplan.runtime.plan.header import InferenceHeader, TrainerHeader

GB = 1e9


def cluster(**over) -> dict:
    base = {"name": "test", "nodes": {"t": {"count": 2, "gpus_per_node": 2}, "i": {"count": 2, "gpus_per_node": 1}},
            "trainer": "t", "inference": "i", "nics_per_gpu": 1, "nic_gbytes_per_s": 50.0, "intra_node_gbytes_per_s": 400.0,
            "descriptor_us": 0.0, "sender_quant_gbytes_per_s": 100.0, "receiver_quant_gbytes_per_s": 200.0}
    return {**base, **over}


def transfers(read, gather=None, sender=None, receiver=None, descriptors=None, second_hops=None) -> PlanTransfers:
    read = np.array(read, dtype=np.float64)
    n_src, n_dst = read.shape
    hops = None if second_hops is None else np.array(second_hops, dtype=np.float64)
    return PlanTransfers(read, np.zeros_like(read) if descriptors is None else np.array(descriptors, dtype=np.float64),
                         np.zeros((n_src, n_src)) if gather is None else np.array(gather, dtype=np.float64),
                         np.zeros((n_src, n_src)) if gather is None else (np.array(gather) > 0).astype(np.float64),
                         np.zeros(n_src) if sender is None else np.array(sender, dtype=np.float64),
                         np.zeros(n_dst) if receiver is None else np.array(receiver, dtype=np.float64),
                         hops, None if hops is None else (hops > 0).astype(np.float64))


def test_one_transfer_takes_its_bytes_over_the_nic_rate_plus_its_descriptors():
    assert predict(transfers([[10 * GB]]), parse_cluster(cluster())).sync_s == pytest.approx(0.2, rel=1e-12)
    slow = parse_cluster(cluster(descriptor_us=2.0))
    assert predict(transfers([[10 * GB]], descriptors=[[1000]]), slow).sync_s == pytest.approx(0.2 + 1000 * 2e-6, rel=1e-12)


def test_tcp_efficiency_slows_the_nic_and_read_latency_delays_each_read():
    """The optional network fields (a TCP-over-Ethernet cluster, bench-network): payload at `wire_efficiency` of the
    line rate over NICs (not the intra-node link), and `read_latency_us` before each read's bytes flow."""
    tcp = parse_cluster(cluster(wire_efficiency=0.5, read_latency_us=1000.0))
    assert predict(transfers([[10 * GB]]), tcp).sync_s == pytest.approx(0.4 + 0.001, rel=1e-12)
    # Two readers of one trainer: both delays run side by side, then the trainer's NIC is shared.
    assert predict(transfers([[5 * GB, 5 * GB]]), tcp).sync_s == pytest.approx(0.001 + 0.4, rel=1e-12)
    ideal = parse_cluster(cluster())
    assert (ideal.wire_efficiency, ideal.read_latency_us) == (1.0, 0.0)
    assert len(predict(transfers([[10 * GB]]), ideal).tasks) == 1  # no latency task: predictions as before


def test_two_transfers_share_one_nic_fairly_then_the_survivor_gets_all_of_it():
    p = predict(transfers([[10 * GB], [5 * GB]]), parse_cluster(cluster()))
    # Both at 25 GB/s until the 5 GB one lands at 0.2 s; the other's last 5 GB at 50 GB/s: 0.1 s more.
    assert sorted(p.schedule.finish.tolist()) == pytest.approx([0.2, 0.3], rel=1e-12)
    assert p.sync_s == pytest.approx(0.3, rel=1e-12)
    assert p.nic_busy["inference 0 NIC in"] == pytest.approx(1.0)
    assert p.nic_busy["trainer 1 NIC out"] == pytest.approx((5 / 50) / 0.3)  # 5 GB at 50 GB/s over a 0.3 s sync
    assert [s["phase"] for s in p.critical_path] == ["read"] and p.critical_path[0]["limited_by"] == "inference 0 NIC in"


def test_max_min_fairness_gives_a_second_bottleneck_the_capacity_left():
    # A and B share R1 (1/s): 0.5 each; C shares R2 (3/s) with B: gets 3 - 0.5 = 2.5 until B ends at 2 s,
    # then 3/s alone for its last unit: 2 + 1/3 s.
    res = [Resource("R1", 1.0), Resource("R2", 3.0)]
    s = simulate(res, [Task("A", "read", "a", 1.0, (0,)), Task("B", "read", "b", 1.0, (0, 1)), Task("C", "read", "c", 6.0, (1,))])
    assert s.finish.tolist() == pytest.approx([2.0, 2.0, 2.0 + 1 / 3], rel=1e-12)
    assert s.busy.tolist() == pytest.approx([2.0, (0.5 * 2 + 2.5 * 2 + 3 * (1 / 3)) / 3], rel=1e-12)


def test_a_chain_of_hops_adds_up():
    # trainer 1 -> trainer 0 (same node: 400 GB/s link) 4 GB, trainer 0 quantizes 10 GB (100 GB/s),
    # then trainer 0 -> inference 0 over the NICs 5 GB (50 GB/s), then inference 0 quantizes 2 GB (200 GB/s).
    p = predict(transfers([[5 * GB], [0]], gather=[[0, 0], [4 * GB, 0]], sender=[10 * GB, 0], receiver=[2 * GB]),
                parse_cluster(cluster()))
    assert p.sync_s == pytest.approx(0.01 + 0.1 + 0.1 + 0.01, rel=1e-12)
    assert [s["phase"] for s in p.critical_path] == ["gather", "sender-quantize", "read", "receiver-quantize"]
    assert p.critical_path[0]["limited_by"] == "trainer 0 link in"  # a tie names the receiving end
    assert p.phase_end_s["read"] == pytest.approx(0.21, rel=1e-12)


def one_inference_node(gpus: int, **over) -> dict:
    """One trainer GPU, and `gpus` inference GPUs on one node (their links: 400 GB/s per direction)."""
    return cluster(nodes={"t": {"count": 1, "gpus_per_node": 1}, "i": {"count": 1, "gpus_per_node": gpus}}, **over)


def test_a_second_hop_starts_when_its_pullers_reads_and_quantization_ended():
    # trainer 0 -> inference 0 (the puller) 10 GB over the NICs (50 GB/s): 0.2 s; inference 0 quantizes 2 GB
    # (200 GB/s): 0.01 s; then inference 1 reads 4 GB from it over the node's link (400 GB/s): 0.01 s.
    p = predict(transfers([[10 * GB, 0]], receiver=[2 * GB, 0], second_hops=[[0, 4 * GB], [0, 0]]),
                parse_cluster(one_inference_node(2)))
    assert p.sync_s == pytest.approx(0.2 + 0.01 + 0.01, rel=1e-12)
    assert [s["phase"] for s in p.critical_path] == ["read", "receiver-quantize", "second-hop"]
    assert p.critical_path[-1]["task"] == "inference 0 -> inference 1"
    assert p.critical_path[-1]["limited_by"] == "inference 1 link in"  # a tie names the receiving end
    assert p.phase_end_s["second-hop"] == pytest.approx(0.22, rel=1e-12)
    d = p.as_dict()
    assert d["inference_nic_bytes"]["max"] == 10 * GB  # first hops only
    assert d["second_hop_bytes"] == {"max": 4 * GB, "mean": 2 * GB, "served_max": 4 * GB, "total": 4 * GB}
    assert p.nic_busy["inference 0 link out"] == pytest.approx(0.01 / 0.22)


def test_two_peers_reading_one_puller_share_its_link():
    # The puller's 10 GB first hop ends at 0.2 s. Peers 1 (2 GB) and 2 (4 GB) share its link out (400 GB/s):
    # 200 GB/s each until peer 1's lands at 0.21 s, then peer 2's last 2 GB at 400 GB/s: 0.005 s more.
    p = predict(transfers([[10 * GB, 0, 0]], second_hops=[[0, 2 * GB, 4 * GB], [0, 0, 0], [0, 0, 0]]),
                parse_cluster(one_inference_node(3)))
    finish = {t.name: float(p.schedule.finish[k]) for k, t in enumerate(p.tasks)}
    assert finish["inference 0 -> inference 1"] == pytest.approx(0.21, rel=1e-12)
    assert finish["inference 0 -> inference 2"] == pytest.approx(0.215, rel=1e-12)
    assert p.sync_s == pytest.approx(0.215, rel=1e-12)
    assert p.critical_path[-1]["limited_by"] == "inference 0 link out"
    assert p.nic_busy["inference 0 link out"] == pytest.approx((6 / 400) / 0.215)


def test_a_plan_without_fanout_has_no_second_hop_phase():
    p = predict(transfers([[10 * GB]]), parse_cluster(cluster()))
    assert "second-hop" not in p.phase_end_s and "second_hop_bytes" not in p.as_dict()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 50)), min_size=1, max_size=12),
       st.lists(st.integers(1, 5), min_size=4, max_size=4))
def test_fair_sharing_bounds(flows, capacities):
    """No resource over capacity, and the makespan lies between the busiest resource's own time
    and every task run one after another at its slowest resource."""
    res = [Resource(f"r{k}", float(c)) for k, c in enumerate(capacities)]
    tasks = [Task(f"t{k}", "read", "x", float(w), tuple(sorted({a, b}))) for k, (a, b, w) in enumerate(flows)]
    s = simulate(res, tasks)
    load = np.zeros(len(res))
    for t in tasks:
        load[list(t.resources)] += t.work
    assert (s.busy <= s.makespan * (1 + 1e-9)).all()
    assert s.busy == pytest.approx(load / np.array(capacities, dtype=float))
    assert s.makespan >= (load / np.array(capacities)).max() * (1 - 1e-9)
    assert s.makespan <= sum(t.work / min(capacities[r] for r in t.resources) for t in tasks) * (1 + 1e-9)


@pytest.mark.parametrize("change,field", [
    ({"nic_gbytes_per_s": "fast"}, "nic_gbytes_per_s"),
    ({"nic_gbytes_per_s": 0}, "nic_gbytes_per_s"),
    ({"descriptor_us": -1}, "descriptor_us"),
    ({"nics_per_gpu": 1.5}, "nics_per_gpu"),
    ({"nodes": {"t": {"count": 0, "gpus_per_node": 2}, "i": {"count": 1, "gpus_per_node": 1}}}, "nodes.t.count"),
    ({"nodes": {"t": {"count": 1}}}, "nodes.t"),
    ({"inference": "elsewhere"}, "inference"),
    ({"bandwidth": 3}, "bandwidth"),
    ({"sources": {"nic_gbytes_per_s": 7}}, "sources"),
    ({"wire_efficiency": 1.5}, "wire_efficiency"),
    ({"wire_efficiency": 0}, "wire_efficiency"),
    ({"read_latency_us": -3}, "read_latency_us"),
    ({"read_latency_us": "slow"}, "read_latency_us"),
])
def test_bad_cluster_field_is_named(change, field):
    with pytest.raises(ClusterError, match=f"'{field}'"):
        parse_cluster(cluster(**change))


def test_missing_field_and_unknown_shipped_name():
    data = cluster()
    del data["trainer"]
    with pytest.raises(ClusterError, match="missing field 'trainer'"):
        parse_cluster(data)
    with pytest.raises(ClusterError, match="no cluster file 'nowhere' and no shipped cluster of that name"):
        resolve_cluster("nowhere")
    assert resolve_cluster("dgx-h200-seed").gpus("trainer") == 64 and resolve_cluster("loopback").name == "loopback"


def two_rank_plan(path, ranks: int = 2) -> str:
    """`ranks` trainer ranks (fsdp) serving one (4 * ranks)x4 bf16 tensor whole to `ranks` inference ranks (dp)."""
    shape = (4 * ranks, 4)
    sources = (TensorEntry("w", shape, "bfloat16"),)
    layout = TrainerLayout(ranks).bind(sources)
    zeros, each = np.zeros(ranks, dtype=np.int64), np.arange(ranks)
    runs = Runs.plain(zeros, zeros, zeros, 16 * each, np.full(ranks, 16), zeros, each)
    program = Program(
        sources=sources, dests=(TensorEntry("w", shape, "bfloat16", ranks=tuple(range(ranks))),), runs=runs,
        cast_chains=(("bfloat16",),),
        origin=PlanOrigin(vllm_version="test", model="two-rank", config_sha256="", architecture="none",
                          trainer=TrainerHeader("hf", "bf16", layout.token, layout.classes),
                          inference=InferenceHeader(f"tp1-dp{ranks}", 1, ranks, False, "cpu"),
                          quant="none", src_ranks=ranks, dst_ranks=ranks),
        trainer_layout=layout)
    write_program(program, path)
    return str(path)


def test_plan_transfers_count_each_holder(tmp_path):
    t = plan_transfers(load_plan(two_rank_plan(tmp_path / "p.plan")))
    assert t.read_bytes.tolist() == [[32, 32], [32, 32]] and t.read_descriptors.tolist() == [[1, 1], [1, 1]]


def test_cli_bad_cluster_file_is_one_error_line(tmp_path, capsys):
    plan = two_rank_plan(tmp_path / "p.plan")
    bad = tmp_path / "bad.json"
    for text, needle in (("{", "is not valid JSON"), (json.dumps(cluster(nic_gbytes_per_s=None)), "'nic_gbytes_per_s'"),
                         (json.dumps(cluster(nodes={"t": {"count": 1, "gpus_per_node": 1}, "i": {"count": 2, "gpus_per_node": 1}})),
                          "2 trainer ranks")):
        bad.write_text(text)
        assert simulate_main([plan, "--cluster", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err and err.count("\n") == 1 and "Traceback" not in err


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_reports_render_svg(tmp_path, capsys):
    plan = two_rank_plan(tmp_path / "p.plan")
    cfile = tmp_path / "c.json"
    cfile.write_text(json.dumps(cluster()))
    assert inspect_main([plan, "--html", str(tmp_path / "inspect.html")]) == 0
    capsys.readouterr()
    assert simulate_main([plan, "--cluster", str(cfile), "--html", str(tmp_path / "sim.html"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sync_s"] == pytest.approx(64 / 50e9, rel=1e-9)
    for name, timeline in (("inspect.html", False), ("sim.html", True)):
        text = (tmp_path / name).read_text()
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "<script" not in text
        parser = _Tags()
        parser.feed(text)
        svgs = [a for tag, a in parser.tags if tag == "svg"]
        assert any(a.get("id") == "byte-matrix" for a in svgs)
        assert sum(a.get("class") == "rank-bars" for a in svgs) == 2
        assert any(a.get("id") == "timeline" for a in svgs) == timeline
        assert sum(tag == "rect" for tag, _ in parser.tags) >= 4 + 4 + (2 if timeline else 0)


def test_transfers_agree_with_inspect_plans_bytes(plan_cache):
    """The simulator's per-pair bytes sum to inspect-plan's per-rank bytes, fp8 tables included."""
    plan = load_plan(plan_cache("fp8-glm", "stacked", "bf16", "fsdp=4,ep=2,replicas=2", "dp=2,ep", "fp8_per_block"))
    t = plan_transfers(plan)
    dst, src, gathered = per_rank_bytes(plan)
    assert t.read_bytes.sum(axis=0).tolist() == dst
    assert (t.read_bytes.sum(axis=1) + t.gather_bytes.sum(axis=1)).tolist() == src
    assert t.gather_bytes.sum() == gathered
    assert t.sender_quant_bytes.sum() > 0


FANOUT = "dp=4,ep,gpus-per-node=2"


def test_fanout_plan_moves_fewer_bytes_over_the_nics_and_reports_its_second_hops(plan_cache, tmp_path, capsys):
    """tiny Qwen3-MoE, fsdp=2 -> dp=4,ep on 2 nodes of 2: the replicated entries cross the NICs once per node."""
    fan = plan_cache("tiny-qwen3-moe", "hf", "bf16", "fsdp=2", FANOUT)
    flat = plan_cache("tiny-qwen3-moe", "hf", "bf16", "fsdp=2", "dp=4,ep")
    plan = load_plan(fan)
    assert plan.fanout is not None and plan.fanout.gpus_per_node == 2
    t, t_flat = plan_transfers(plan), plan_transfers(load_plan(flat))
    first, without = t.read_bytes.sum(axis=0), t_flat.read_bytes.sum(axis=0)
    assert first.max() < without.max() and first.sum() < without.sum()
    # bf16 without casts: what a rank no longer pulls from the trainers it reads whole from its node's puller
    assert (first + t.second_hop_bytes.sum(axis=0)).tolist() == without.tolist()
    assert all(plan.fanout.node_of(p) == plan.fanout.node_of(i) for p, i in zip(*np.nonzero(t.second_hop_bytes)))
    dst, _, _ = per_rank_bytes(plan.pulling)
    assert first.tolist() == dst

    cfile = tmp_path / "c.json"
    cfile.write_text(json.dumps(cluster(nodes={"t": {"count": 1, "gpus_per_node": 2}, "i": {"count": 2, "gpus_per_node": 2}})))
    p = predict(t, parse_cluster(json.loads(cfile.read_text())))
    hops = [k for k, task in enumerate(p.tasks) if task.phase == "second-hop"]
    assert hops and all(" link " in p.resources[r].name for k in hops for r in p.tasks[k].resources)
    for k in hops:  # each second hop starts once every read into its puller landed
        puller = p.tasks[k].name.split(" -> ")[0]
        reads = [j for j, task in enumerate(p.tasks) if task.phase == "read" and task.rank == puller]
        assert p.schedule.start[k] >= max(p.schedule.finish[j] for j in reads)

    assert inspect_main([str(fan), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    f = summary["fanout"]
    assert f["gpus_per_node"] == 2 and f["entries"] == len(plan.fanout.first_hops)
    assert f["first_hop_max"] == first.max() < f["without_fanout_max"] == without.max()
    assert f["second_hop_per_dst_rank"] == t.second_hop_bytes.sum(axis=0).tolist()
    assert summary["wire_bytes"] == first.sum()
    assert inspect_main([str(fan)]) == 0
    text = capsys.readouterr().out
    assert "fan-out        gpus-per-node 2:" in text and "without fan-out" in text
    assert inspect_main([str(flat), "--json"]) == 0 and json.loads(capsys.readouterr().out)["fanout"] is None

    assert inspect_main([str(fan), "--html", str(tmp_path / "inspect.html")]) == 0
    assert simulate_main([str(fan), "--cluster", str(cfile), "--html", str(tmp_path / "sim.html")]) == 0
    text = capsys.readouterr().out
    assert "second hops" in text and "second-hop" in text
    for name, timeline in (("inspect.html", False), ("sim.html", True)):
        parser = _Tags()
        parser.feed((tmp_path / name).read_text())
        svgs = [a for tag, a in parser.tags if tag == "svg"]
        assert any(a.get("id") == "second-hop-matrix" for a in svgs)
        assert sum(a.get("class") == "rank-bars" for a in svgs) == 3  # trainers, inference first + second hops, served
        rects = [a.get("class") for tag, a in parser.tags if tag == "rect"]
        assert rects.count("first-hop") == 2 + 4 and rects.count("second-hop") >= 4 + 4 + (4 if timeline else 0)


def test_fp8_fanout_second_hops_wait_for_the_pullers_quantization(plan_cache):
    plan = load_plan(plan_cache("fp8-glm", "hf", "bf16", "fsdp=3", FANOUT, "fp8_per_block"))  # experts: receiver side
    t = plan_transfers(plan)
    assert t.receiver_quant_bytes.sum() > 0 and t.second_hop_bytes.sum() > 0
    p = predict(t, parse_cluster(cluster(nodes={"t": {"count": 1, "gpus_per_node": 3}, "i": {"count": 2, "gpus_per_node": 2}})))
    quantized = {task.rank: float(p.schedule.finish[k]) for k, task in enumerate(p.tasks) if task.phase == "receiver-quantize"}
    hops = [(task.name.split(" -> ")[0], float(p.schedule.start[k])) for k, task in enumerate(p.tasks) if task.phase == "second-hop"]
    assert any(puller in quantized for puller, _ in hops)
    assert all(start >= quantized[puller] for puller, start in hops if puller in quantized)


@pytest.mark.parametrize("inference", ["tp=1", FANOUT], ids=["plain", "fanout"])
def test_text_report_renders_for_plans_with_and_without_fanout(plan_cache, tmp_path, capsys, inference):
    """simulate-plan's text output (the default): a plain plan on the shipped loopback cluster has no second-hop
    line; a fan-out plan on 2 nodes of 2 GPUs has one."""
    plan = plan_cache("tiny-qwen3-moe", "hf", "bf16", "fsdp=2", inference)
    where = "loopback"
    if inference == FANOUT:
        where = str(tmp_path / "c.json")
        Path(where).write_text(json.dumps(cluster(nodes={"t": {"count": 1, "gpus_per_node": 2},
                                                         "i": {"count": 2, "gpus_per_node": 2}})))
    assert simulate_main([str(plan), "--cluster", where]) == 0
    text = capsys.readouterr().out
    assert text.startswith("predicted sync on ") and "critical path" in text
    assert ("second hops" in text) == (inference == FANOUT)


@pytest.mark.parametrize("kind,needle", [
    ("fifo", "is not a regular file"), ("device", "is not a regular file"), ("not utf-8", "is not UTF-8 text"),
    ("deep nesting", "nested too deeply"), ("5000-digit integer", "Exceeds the limit"),
    ("rate 1e-300", "'nic_gbytes_per_s' must be a number in 0.001..1e+06"),
    ("descriptor_us 1e308", "'descriptor_us' must be a number in 0..1e+06"),
    ("a billion nodes", "'nodes.t.count' must be an integer in 1..4096"),
])
def test_cli_hostile_cluster_files_are_one_line_in_bounded_time(tmp_path, capsys, kind, needle):
    import os

    plan = two_rank_plan(tmp_path / "p.plan")
    path = tmp_path / "cluster.json"
    texts = {"not utf-8": b'{"name": "\xff"}', "deep nesting": b"[" * 100_000 + b"]" * 100_000,
             "5000-digit integer": b'{"nics_per_gpu": ' + b"9" * 5000 + b"}",
             "rate 1e-300": json.dumps(cluster(nic_gbytes_per_s=1e-300)).encode(),
             "descriptor_us 1e308": json.dumps(cluster(descriptor_us=1e308)).encode(),
             "a billion nodes": json.dumps(cluster(nodes={"t": {"count": 10**9, "gpus_per_node": 1},
                                                          "i": {"count": 2, "gpus_per_node": 1}})).encode()}
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path = Path("/dev/zero")
    else:
        path.write_bytes(texts[kind])
    assert simulate_main([plan, "--cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1


def test_the_html_report_of_4096_by_4096_ranks_is_bounded(tmp_path):
    """Issue 27 item 6: beyond 128 ranks per axis the heat map draws bins of consecutive ranks, beyond 512 the bars
    do: the page stays a few MB whatever the rank count (it drew one cell per rank pair, 16M here, before)."""
    plan = two_rank_plan(tmp_path / "p.plan", ranks=4096)
    assert inspect_main([plan, "--html", str(tmp_path / "inspect.html")]) == 0
    text = (tmp_path / "inspect.html").read_text()
    parser = _Tags()
    parser.feed(text)
    assert sum(tag == "rect" for tag, _ in parser.tags) <= 128 * 128 + 2 * 512
    assert len(text) < 8 << 20
    assert "trainer ranks 0-31 -&gt; inference ranks 0-31: 32,768 bytes" in text  # 32 x 32 pairs of 32 bytes each


def delta_transfers(read, served, stage=None, units=None, **kw) -> PlanTransfers:
    import dataclasses

    base = transfers(read, **kw)
    return dataclasses.replace(base, served_bytes=np.array(served, dtype=np.float64), unit_bytes=units or {2: float(sum(served))},
                               stage_read_bytes=np.zeros_like(base.read_bytes) if stage is None else np.array(stage, dtype=np.float64))


def test_page_ratio_follows_the_runtimes_encodings():
    """The wire ratio comes from runtime/delta/encode.py's sizes: near bench-delta's measured gaps column at 2%
    (0.031 of page bytes), growing with density, and RAW (every unit plus a header and the index) when all changed."""
    from weightplan.compiler.simulate.delta import page_ratio

    assert 0.028 < page_ratio(0.02, 2) < 0.034
    ratios = [page_ratio(d, 2) for d in (0.001, 0.01, 0.05, 0.3, 1.0)]
    assert ratios == sorted(ratios) and ratios[0] < 0.003
    assert ratios[-1] == pytest.approx(1 + 16 / 65536, rel=1e-9)
    assert page_ratio(0.01, 1) > page_ratio(0.01, 2) > page_ratio(0.01, 4)  # a position costs more per value byte


def test_a_delta_sync_adds_encode_and_apply_to_a_read_of_the_delta_bytes():
    from weightplan.compiler.simulate.delta import DeltaSync, page_ratio

    rates = parse_cluster(cluster(delta_encode_gbytes_per_s=20.0, delta_apply_gbytes_per_s=5.0))
    t = delta_transfers([[10 * GB]], served=[40 * GB])
    ratio = page_ratio(0.01, 2)
    p = predict(t, rates, DeltaSync(0.01))
    assert p.sync_s == pytest.approx(40 / 20 + 10 * ratio / 50 + 10 * ratio / 5, rel=1e-9)
    assert [s["phase"] for s in p.critical_path] == ["sender-encode", "read", "receiver-apply"]
    assert p.as_dict()["delta"]["wire_ratio"] == pytest.approx(ratio) and p.inference_bytes.tolist() == [10 * GB * ratio]
    assert predict(t, rates).sync_s == pytest.approx(0.2, rel=1e-12)  # without delta: the full read only


def test_a_delta_sync_reads_stage_copies_and_second_hops_whole():
    from weightplan.compiler.simulate.delta import DeltaSync, page_ratio

    rates = parse_cluster(one_inference_node(2, delta_encode_gbytes_per_s=1e6, delta_apply_gbytes_per_s=1e6))
    t = delta_transfers([[10 * GB, 0]], served=[10 * GB], stage=[[2 * GB, 0]], second_hops=[[0, 4 * GB], [0, 0]])
    p = predict(t, rates, DeltaSync(0.01))
    ratio = page_ratio(0.01, 2)
    first = (2 + 8 * ratio) / 50
    assert p.phase_end_s["read"] == pytest.approx(1e-5 + first, rel=1e-6)
    assert p.sync_s == pytest.approx(p.phase_end_s["receiver-apply"] + 4 / 400, rel=1e-9)


def test_delta_needs_a_density_in_range_and_a_cluster_with_its_rates(tmp_path, capsys):
    from weightplan.compiler.simulate.delta import DeltaModelError, DeltaSync

    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(DeltaModelError, match="delta density must be in"):
            DeltaSync(bad)
    plan = two_rank_plan(tmp_path / "p.plan")
    t = plan_transfers(load_plan(plan))
    assert t.served_bytes.tolist() == [32, 32] and t.unit_bytes == {2: 64.0}
    no_rates = tmp_path / "no-rates.json"
    no_rates.write_text(json.dumps(cluster()))
    capsys.readouterr()
    assert simulate_main([plan, "--cluster", str(no_rates), "--delta-density", "0.01"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "delta_encode_gbytes_per_s" in err[0], err
    assert simulate_main([plan, "--cluster", str(no_rates), "--delta-density", "2"]) == 2
    assert "delta density must be in (0, 1]" in capsys.readouterr().err
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps(cluster(delta_encode_gbytes_per_s=1.0, delta_apply_gbytes_per_s=0.5)))
    assert simulate_main([plan, "--cluster", str(rates), "--delta-density", "0.01"]) == 0
    assert "delta sync      density 0.01: wire ratio" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(cluster(delta_apply_gbytes_per_s="fast")))
    assert simulate_main([plan, "--cluster", str(bad)]) == 2
    assert "field 'delta_apply_gbytes_per_s' must be a number" in capsys.readouterr().err


def test_pipelined_plan_places_each_inference_stage_on_its_own_node(plan_cache, tmp_path, capsys):
    """tp=2,pp=2 on inference nodes of 2 GPUs: ranks fill nodes in vLLM's (dp, pp, tp) order, so each pipeline stage
    is one node, and each node receives exactly the bytes its stage's ranks hold (trainer stages feed them as
    inspect-plan counts); the shipped loopback cluster has a process slot for each of the 8 ranks."""
    path = plan_cache("tiny-llama", "hf", "bf16", "pp=2,fsdp=2", "tp=2,pp=2")
    plan = load_plan(path)
    nodes = parse_cluster(cluster(nodes={"t": {"count": 2, "gpus_per_node": 2}, "i": {"count": 2, "gpus_per_node": 2}}))
    p = predict(plan_transfers(plan), nodes)
    assert p.inference_nodes == ("i/0", "i/0", "i/1", "i/1")
    assert [plan.header.inference.rank_coords(r).pp for r in range(4)] == [0, 0, 1, 1]
    held = {f"i/{stage}": sum(e.nbytes for e in plan.dests for r in e.ranks if plan.header.inference.rank_coords(r).pp == stage)
            for stage in (0, 1)}
    assert p.node_bytes() == held and held["i/0"] > 0 and held["i/1"] > 0
    assert p.as_dict()["inference_node_bytes"] == held
    pairs = np.array(stage_pair_bytes(plan))
    assert pairs.sum(axis=0).tolist() == [held["i/0"], held["i/1"]]
    # No byte crosses from a trainer stage to an inference stage whose layers it does not hold.
    t = plan_transfers(plan)
    for s in range(2):
        for stage in range(2):
            block = t.read_bytes[2 * s:2 * s + 2, 2 * stage:2 * stage + 2]
            assert block.sum() == pairs[s, stage]
    assert simulate_main([str(path), "--cluster", "loopback"]) == 0
    text = capsys.readouterr().out
    assert "process/4 " in text and "(stage 0)" in text and "(stage 1)" in text and "process/0 " not in text.split("per node")[1]
