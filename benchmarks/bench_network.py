"""`make bench-network`: a plan synced over emulated nodes at three link rates against `simulate-plan`; last line JSON.

Nodes (testing/emulated_cluster.py, UCX over TCP): the store on s0, trainer ranks 0 and 1 on t0 and t1,
inference ranks 0 and 1 on i0 and i1, each node's link rate-limited with tbf at the rate under test. The plan is a
Qwen3-MoE config (tests/configs/tiny-qwen3-moe's architecture scaled up; fsdp=2 -> dp=2,ep, about 35 MB per
reader). Workers are testing/runtime_worker.py processes; the trainers publish every version at once,
the readers start each sync together when the benchmark opens its gate, after every trainer published it.

measured_s: from the first reader's start to the last reader's end (median over --repeats syncs per rate; a first
sync at the highest rate makes the connections and is not counted). predicted_s: `simulate-plan --cluster FILE`
for the cluster file written here, which describes these nodes: one GPU and one NIC per node, the NIC at the link
rate; `wire_efficiency`, the lower of the payload share of the link rate TCP alone (no UCX) gets into each reader
node when the sync's 4 connections send at once (measured at each rate) and the transport's own ceiling here over
the link rate (the same plan's syncs with the links at 10 Gbit/s: UCX's TCP path is bound by this host's CPU,
shared with other sessions); `read_latency_us`, the median sync of a tiny plan of the
same layout (its own job, before the measured plan) less its bytes' time in the model. error is
predicted / measured - 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from weightplan.testing.emulated_cluster import EmulatedCluster, EmulatedClusterError
from weightplan.testing.runtime_harness import Job

BASE = ROOT / "tests" / "configs" / "tiny-qwen3-moe"
SCALED = {"hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256, "num_experts": 8,
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 8192}
# Rates UCX's TCP path sustains here even with the 2 cores shared: at 500-1000 Mbit/s a sync ran at 0.55-0.95 of the
# link rate depending on the other sessions' load (CPU-bound copies), at 200 Mbit/s and below at the link's rate.
RATES_MBIT = (50.0, 100.0, 200.0)
TCP_PROBE_SECONDS = 1.0  # of traffic at the link rate per flow and goodput probe
UNLIMITED_MBIT = 10000.0  # tbf at 10 Gbit/s: far above what UCX's TCP path moves here
FLOWS = [(f"t{r}", f"i{k}") for r in range(2) for k in range(2)]  # the sync's connections: every trainer to every reader


def write_config(out: Path, smoke: bool) -> Path:
    """The benchmark's model config: tiny-qwen3-moe itself with --smoke, else scaled up (SCALED)."""
    config = json.loads((BASE / "config.json").read_text())
    if not smoke:
        config.update(SCALED)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def compile_network_plan(tmp: Path, smoke: bool) -> Path:
    from weightplan.compiler.compile import CompileOptions, compile_plan

    path = tmp / "network.plan"
    compile_plan(CompileOptions(str(write_config(tmp / "model", smoke)), "stacked", "bf16", "none", path,
                                trainer="fsdp=2", inference="dp=2,ep"))
    return path


def cluster_file(rate_mbit: float, efficiency: float, per_read_us: float) -> dict:
    """A simulate-plan cluster file describing the emulated nodes at `rate_mbit`, where one TCP connection carries
    `efficiency` of the line rate as payload."""
    nic = rate_mbit * 1e6 / 8 / 1e9
    return {
        "name": f"emulated-tcp-{rate_mbit:g}mbit",
        "description": "bench-network's emulated nodes: one process per network namespace, each link rate-limited "
                       f"with tbf at {rate_mbit:g} Mbit/s both ways, UCX over TCP",
        "nodes": {"trainer": {"count": 2, "gpus_per_node": 1}, "inference": {"count": 2, "gpus_per_node": 1}},
        "trainer": "trainer", "inference": "inference",
        "nics_per_gpu": 1, "nic_gbytes_per_s": nic, "intra_node_gbytes_per_s": nic,
        "descriptor_us": 0.0, "sender_quant_gbytes_per_s": 1.0, "receiver_quant_gbytes_per_s": 1.0,
        "wire_efficiency": round(efficiency, 4), "read_latency_us": per_read_us,
        "sources": {"nic_gbytes_per_s": "the tbf rate of every node's link",
                    "wire_efficiency": "bench_network.py: the lower of (a) the payload rate TCP alone (no UCX) gives "
                                       "each reader node when the sync's 4 connections (every trainer node to every "
                                       "reader node) send at once, measured before the syncs at this rate, and (b) "
                                       "the transport's ceiling here (the same plan's syncs with the links at 10 "
                                       "Gbit/s, bound by the host's shared CPU), both over the link rate",
                    "read_latency_us": "bench_network.py: the median sync of a tiny plan (tests/configs/tiny-qwen3-moe, "
                                       "the same layout) at the highest rate, less its bytes' time in this model",
                    "intra_node_gbytes_per_s": "unused: one process per node",
                    "descriptor_us": "runs under 64 KiB travel packed; the rest are few and large",
                    "sender_quant_gbytes_per_s": "unused: a bf16 plan", "receiver_quant_gbytes_per_s": "unused: a bf16 plan"},
    }


def predict(plan: Path, cluster: dict, tmp: Path) -> float:
    """`simulate-plan PLAN --cluster FILE --json`'s predicted sync time."""
    path = tmp / f"{cluster['name']}.json"
    path.write_text(json.dumps(cluster, indent=1))
    code = "import sys; from weightplan.compiler.cli import simulate_main; sys.exit(simulate_main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, str(plan), "--cluster", str(path), "--json"],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"bench-network: simulate-plan failed: {done.stderr.strip()[-400:]}")
    return float(json.loads(done.stdout)["sync_s"])


def sync_wall(job: Job, case: str, version: int) -> float:
    """From the first reader's start of `version` of `case` to the last reader's end."""
    events = [job.event(f"inf{k}", ("synced", "failed"), version, timeout=600) for k in range(2)]
    failed = [e for e in events if e["event"] != "synced" or e["n_differ"]]
    if failed:
        raise SystemExit(f"bench-network: version {version} of {case} did not sync exactly: {failed[0]}")
    return max(e["at"] for e in events) - min(e["at"] - e["seconds"] for e in events)


def run_syncs(job: Job, case: str, versions: list[int]) -> list[float]:
    """Each version of `case` once every trainer published it, the readers started together: its wall time."""
    walls = []
    for version in versions:
        for r in range(2):
            job.event(f"tr{r}", "published", version, timeout=600)
        job.go(version)
        walls.append(sync_wall(job, case, version))
    return walls


def start_workers(job: Job, versions: int) -> list[int]:
    """Trainer ranks 0, 1 on t0, t1 (publishing each version as soon as the last was released) and gated plain readers
    on i0, i1, for versions 1..`versions`."""
    listed = ",".join(str(v) for v in range(1, versions + 1))
    for r in range(2):
        job.start(f"tr{r}", "trainer", r, "--versions", listed, "--wait-joined", "--timeout", "600", node=f"t{r}")
    for k in range(2):
        job.start(f"inf{k}", "inference", k, "--plain", "--gate", "--versions", listed, "--timeout", "600", node=f"i{k}")
    return list(range(1, versions + 1))


def set_rate(cluster: EmulatedCluster, rate: float, smoke: bool) -> float:
    """Every node's link at `rate`; returns TCP's payload share of it into each reader node (the sync's pattern)."""
    for node in ("t0", "t1", "i0", "i1"):
        cluster.set_rate(node, rate)
    probe = max(2 << 20, int(rate * 1e6 / 8 * (0.1 if smoke else TCP_PROBE_SECONDS)))
    goodput = statistics.median(cluster.tcp_goodput(FLOWS, probe) for _ in range(3)) / 2
    efficiency = goodput / (rate * 1e6 / 8)
    print(f"{rate:g} Mbit/s: TCP carries {goodput * 8 / 1e6:.1f} Mbit/s of payload into each reader node "
          f"({efficiency:.3f})", file=sys.stderr, flush=True)
    return min(1.0, efficiency)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES_MBIT), help="link rates, Mbit/s")
    parser.add_argument("--repeats", type=int, default=3, help="syncs measured per rate")
    parser.add_argument("--smoke", action="store_true", help="tiny-qwen3-moe, one sync per rate")
    args = parser.parse_args(argv)
    try:
        rates = sorted({float(r) for r in args.rates.split(",")}, reverse=True)
    except ValueError:
        raise SystemExit(f"bench-network: --rates must be comma-separated Mbit/s figures, not {args.rates!r}") from None
    if not rates or min(rates) <= 0 or args.repeats < 1:
        raise SystemExit("bench-network: rates must be positive and --repeats at least 1")
    repeats = 1 if args.smoke else args.repeats
    measured_at = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    measured: dict[float, list[float]] = {}
    tcp_share: dict[float, float] = {}
    with tempfile.TemporaryDirectory(prefix="weightplan-bench-network-") as tmp:
        tmp = Path(tmp)
        plan = compile_network_plan(tmp / "network", args.smoke)
        tiny = compile_network_plan(tmp / "latency", smoke=True)
        nodes = {"s0": None, "t0": rates[0], "t1": rates[0], "i0": rates[0], "i1": rates[0]}
        try:
            with EmulatedCluster(nodes, tag="wpbnet") as cluster:
                tcp_share[rates[0]] = set_rate(cluster, rates[0], args.smoke)
                # The tiny plan, whose bytes take milliseconds: a sync's fixed time beyond its bytes (read_latency_us).
                # Its own job, its store on another node's address (the two stores never share a port).
                with Job(tmp / "latency", tiny, "bench-network-latency", cluster=cluster, store_node="t0") as job:
                    latency_walls = run_syncs(job, "bench-network-latency", start_workers(job, 1 + repeats))[1:]
                print(f"tiny plan at {rates[0]:g} Mbit/s: {latency_walls}", file=sys.stderr, flush=True)
                with Job(tmp / "network", plan, "bench-network", cluster=cluster, store_node="s0") as job:
                    versions = start_workers(job, 1 + (len(rates) + 1) * repeats)
                    run_syncs(job, "bench-network", versions[:1])  # connects
                    # The transport's own ceiling here: the same syncs with links far faster than UCX's TCP path
                    # (bound by this host's shared CPU), measured between the rate-limited ones.
                    for node in ("t0", "t1", "i0", "i1"):
                        cluster.set_rate(node, UNLIMITED_MBIT)
                    ceiling_walls = run_syncs(job, "bench-network", versions[1:1 + repeats])
                    print(f"links at {UNLIMITED_MBIT:g} Mbit/s: {ceiling_walls}", file=sys.stderr, flush=True)
                    versions = versions[repeats:]
                    for i, rate in enumerate(rates):
                        tcp_share[rate] = set_rate(cluster, rate, args.smoke)
                        measured[rate] = run_syncs(job, "bench-network", versions[1 + i * repeats:1 + (i + 1) * repeats])
                        print(f"{rate:g} Mbit/s: {measured[rate]}", file=sys.stderr, flush=True)
                    nbytes = job.event("inf0", "synced", 1)["bytes"]
        except EmulatedClusterError as exc:
            raise SystemExit(f"bench-network: {exc}") from None
        bytes_only = predict(tiny, cluster_file(rates[0], tcp_share[rates[0]], 0.0), tmp)
        per_read_us = round(max(0.0, statistics.median(latency_walls) - bytes_only) * 1e6, 1)
        ceiling = nbytes / statistics.median(ceiling_walls)  # payload bytes per second into one reader
        efficiency = {rate: min(tcp_share[rate], ceiling / (rate * 1e6 / 8)) for rate in rates}
        rows = {}
        for rate in rates:
            m = statistics.median(measured[rate])
            p = predict(plan, cluster_file(rate, efficiency[rate], per_read_us), tmp)
            rows[f"{rate:g}mbit"] = {"measured_s": round(m, 4), "predicted_s": round(p, 4), "error": round(p / m - 1, 4),
                                     "runs": [round(x, 4) for x in measured[rate]],
                                     "tcp_share": round(tcp_share[rate], 4), "wire_efficiency": round(efficiency[rate], 4)}
    print(json.dumps({"rates": rows, "max_abs_error": max(abs(row["error"]) for row in rows.values()),
                      "read_latency_us": per_read_us, "transport_ceiling_mbit": round(ceiling * 8 / 1e6, 1),
                      "bytes_per_reader": nbytes, "measured_at": measured_at,
                      "smoke": args.smoke}))


if __name__ == "__main__":
    main()
