"""`make soak`: K syncs over emulated nodes with faults injected at random points from a fixed seed; last line JSON.

Nodes (testing/emulated_cluster.py, UCX over TCP): the store on s0, trainer ranks 0 and 1 on t0 and t1,
inference ranks 0 and 1 on i0 and i1, every link at --rate Mbit/s. The workers are testing/runtime_worker.py
processes (a tiny Qwen3-MoE plan, fsdp=2 -> dp=2,ep; every reader compares its bytes with the host executor's), gated
version by version, each trainer computing --compute s between publish and release (a training step, during which
the runtime's background poll answers readers). Before each sync a fault may be drawn (--fault-rate), then injected at
a random delay after the sync starts (uniform over 0.8 x the median of the last completed syncs, so it lands while the
sync runs):

- link flap: a node's link goes down for 0.5 s to twice the workers' timeout, then up (the soak waits until it
  carries traffic again);
- long cut: a trainer's or a reader's node (alternately) is partitioned for longer than every timeout, up to
  --max-cut seconds (60), then its link comes back; the cut side must sync again by itself, no process restarted;
- cut past publishing: a reader's node is partitioned right before a version and stays cut while the trainers
  publish that version and PAST_PUBLISH - 1 more (the other reader syncs them), then while the trainers sit idle until
  the cut has lasted its draw (the first such cut: --max-cut exactly); the cut reader must sync the next version
  after its link is back;
- process kill and restart: a trainer or reader is SIGKILLed; a replacement process (new incarnation) joins after
  that sync and takes the following versions;
- slow link: a node's link drops to a tenth of --rate for that sync.

A sync is `completed` when every reader synced it with the reference bytes, `failed_clean` when some reader failed
it with a SyncError and reported no version, a `hang` when some process said nothing within the bound (4 x the
workers' timeout + 10 s; the silent process is then replaced). `mixed` counts readers that reported a version whose
bytes differ from the reference (must be 0), `recovered` the faults after which a later sync (before the next fault)
completed. Per fault, `fault_log` says which node or process, how long a cut lasted, whether a later sync (before the
next fault) completed (`recovered`) and after how many versions (`after_versions`: 1 is the next version); a process
the soak had to replace for a cut (a hang) is in `restarted_for_cut` (must be 0). The soak stops early, saying so,
past --max-seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from weightplan.testing.emulated_cluster import EmulatedCluster, EmulatedClusterError
from weightplan.testing.runtime_harness import Job

MODEL = ROOT / "tests" / "configs" / "tiny-qwen3-moe"
TRAINERS, READERS = 2, 2
FAULTS = ("link_flap", "long_cut", "cut_past_publish", "kill_restart", "slow_link")
PAST_PUBLISH = 3  # versions the trainers publish while a reader's node is cut (fault cut_past_publish)


@dataclass
class Worker:
    """One logical process of the job (a trainer or reader rank) and the key of its current incarnation."""

    role: str
    rank: int
    node: str
    key: str
    restarts: int = 0


@dataclass
class Tally:
    syncs: int = 0
    completed: int = 0
    failed_clean: int = 0
    mixed: int = 0
    hangs: int = 0
    recovered: int = 0
    faults: dict = field(default_factory=lambda: {kind: 0 for kind in FAULTS})
    outcomes: list = field(default_factory=list)
    fault_log: list = field(default_factory=list)  # per fault: what, where, and whether and when a sync completed after it
    longest_cut_s: float = 0.0
    restarted_for_cut: int = 0  # processes replaced because they hung after a link cut


def compile_tiny_plan(out: Path) -> Path:
    from weightplan.compiler.compile import CompileOptions, compile_plan

    path = out / "soak.plan"
    compile_plan(CompileOptions(str(MODEL), "stacked", "bf16", "none", path, trainer=f"fsdp={TRAINERS}",
                                inference=f"dp={READERS},ep"))
    return path


class Soak:
    """Drives the job version by version, injecting faults and tallying outcomes."""

    def __init__(self, job: Job, cluster: EmulatedCluster, args, versions: list[int]):
        self.job, self.cluster, self.args, self.versions = job, cluster, args, versions
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.workers = [Worker("trainer", r, f"t{r}", f"tr{r}") for r in range(TRAINERS)] + \
                       [Worker("inference", k, f"i{k}", f"inf{k}") for k in range(READERS)]
        self.bound = 4 * args.timeout + 10
        self.fault_pending = False  # a fault happened and no sync has completed since
        self.long_cuts = 0  # long cuts alternate between a trainer's node and a reader's
        self.past_publish_cuts = 0
        self.sync_seconds: list[float] = []  # the slowest reader's time of each completed sync

    def start(self, worker: Worker, versions: list[int]) -> None:
        extra = (("--wait-joined", "--busy-after-publish", str(self.args.compute)) if worker.role == "trainer"
                 else ("--plain",))
        self.job.start(worker.key, worker.role, worker.rank, "--versions", ",".join(map(str, versions)), "--gate",
                       "--timeout", str(self.args.timeout), *extra, node=worker.node)

    def replace(self, worker: Worker, after: int) -> None:
        """A new process (new incarnation) for `worker`, taking the versions after `after`."""
        if self.job.procs[worker.key].poll() is None:
            self.job.kill(worker.key)
        worker.restarts += 1
        worker.key = f"{worker.key.split('.')[0]}.{worker.restarts}"
        rest = [v for v in self.versions if v > after]
        if rest:
            self.start(worker, rest)
            self.job.event(worker.key, "ready" if worker.role == "trainer" else "joined", timeout=180)

    def draw_fault(self, version: int):
        if version <= 2 and not self.args.smoke:
            return None  # connect everyone first
        if self.args.smoke:  # one fault of each kind (a long cut of each side), then clean syncs
            kind = {2: "link_flap", 3: "kill_restart", 4: "slow_link", 5: "long_cut", 7: "long_cut",
                    9: "cut_past_publish"}.get(version)
        else:
            kind = self.rng.choice(FAULTS) if self.rng.random() < self.args.fault_rate else None
        if kind is None:
            return None
        if kind == "long_cut":
            role = ("inference", "trainer")[self.long_cuts % 2]
            self.long_cuts += 1
            worker = self.rng.choice([w for w in self.workers if w.role == role])
        elif kind == "cut_past_publish":
            if version + PAST_PUBLISH > self.versions[-1]:
                return None  # too few versions left to publish past the cut and see the reader back
            worker = self.rng.choice([w for w in self.workers if w.role == "inference"])
        else:
            worker = self.rng.choice(self.workers)
        typical = sorted(self.sync_seconds[-10:])[len(self.sync_seconds[-10:]) // 2] if self.sync_seconds else 0.5
        return kind, worker, worker.key, self.rng.uniform(0.0, 0.8 * typical)  # while the sync runs

    def sync(self, version: int) -> int:
        """Drive `version` (and, for a cut past publishing, the versions published during the cut); returns how many."""
        fault = self.draw_fault(version)
        if fault is not None and fault[0] == "cut_past_publish":
            return self.cut_past_publish(version, fault[1])
        killed = None
        self.job.go(version)
        if fault is not None:
            kind, worker, _, delay = fault
            self.tally.faults[kind] += 1
            self.fault_pending = True
            time.sleep(delay)
            if kind in ("link_flap", "long_cut"):
                # TCP rides out the short flaps; a long cut outlasts every timeout (sync, release, store)
                low, high = ((0.5, 2 * self.args.timeout) if kind == "link_flap"
                             else (2 * self.args.timeout + 3, self.args.max_cut))
                cut = self.rng.uniform(low, max(low, high))
                self.cluster.link_down(worker.node)
                time.sleep(cut)
                self.cluster.link_up(worker.node)
                self.tally.longest_cut_s = max(self.tally.longest_cut_s, round(cut, 1))
                self.tally.fault_log.append({"version": version, "kind": kind, "node": worker.node, "cut_s": round(cut, 1),
                                             "recovered": False, "after_versions": None})
            elif kind == "kill_restart":
                self.job.kill(worker.key)
                killed = worker
            else:
                self.cluster.set_rate(worker.node, self.args.rate / 10)
            if kind not in ("link_flap", "long_cut"):
                self.tally.fault_log.append({"version": version, "kind": kind, "node": worker.node, "worker": worker.key,
                                             "recovered": False, "after_versions": None})
        outcome = self.collect(version, killed)
        if fault is not None:
            kind, worker, _, _ = fault
            if kind in ("link_flap", "long_cut"):
                host, port = self.job.address.rsplit(":", 1)
                self.cluster.wait_reachable(worker.node, host, int(port), timeout=30)
            elif kind == "slow_link":
                self.cluster.set_rate(worker.node, self.args.rate)
            elif kind == "kill_restart":
                self.replace(worker, version)
        self.tally.outcomes.append({"version": version, "fault": fault and [fault[0], fault[2]], **outcome})
        return 1

    def cut_past_publish(self, version: int, worker: Worker) -> int:
        """Cut `worker`'s node right before `version`; the trainers publish it and the next PAST_PUBLISH - 1 versions,
        then idle until the cut is over; returns the versions driven (the cut reader must sync the one after)."""
        t = self.tally
        t.faults["cut_past_publish"] += 1
        low = 2 * self.args.timeout + 3
        cut = self.args.max_cut if self.past_publish_cuts == 0 else self.rng.uniform(low, max(low, self.args.max_cut))
        self.past_publish_cuts += 1
        self.fault_pending = True
        self.cluster.link_down(worker.node)
        cut_at = time.monotonic()
        for v in range(version, version + PAST_PUBLISH):
            self.job.go(v)
            outcome = self.collect(v, None)
            self.tally.outcomes.append({"version": v, "fault": ["cut_past_publish", worker.key] if v == version else None,
                                        **outcome})
        time.sleep(max(0.0, cut - (time.monotonic() - cut_at)))  # the trainers idle, alive, while the cut lasts
        self.cluster.link_up(worker.node)
        cut = time.monotonic() - cut_at
        t.longest_cut_s = max(t.longest_cut_s, round(cut, 1))
        t.fault_log.append({"version": version, "kind": "cut_past_publish", "node": worker.node, "cut_s": round(cut, 1),
                            "published_during_cut": PAST_PUBLISH, "recovered": False, "after_versions": None})
        host, port = self.job.address.rsplit(":", 1)
        self.cluster.wait_reachable(worker.node, host, int(port), timeout=30)
        return PAST_PUBLISH

    def collect(self, version: int, killed: Worker | None) -> dict:
        """Wait for every live worker's outcome of `version`; classify the sync."""
        t = self.tally
        t.syncs += 1
        deadline = time.monotonic() + self.bound
        results, silent = {}, []
        for worker in self.workers:
            if worker is killed:
                continue
            kinds = ("synced", "failed") if worker.role == "inference" else ("released", "failed")
            try:
                results[worker.key] = self.job.event(worker.key, kinds, version,
                                                     timeout=max(1.0, deadline - time.monotonic()))
            except AssertionError:  # no word within the bound, or the process died: a hang to count and replace
                silent.append(worker)
        readers = [e for key, e in results.items() if key.startswith("inf")]
        mixed = sum((e["event"] == "synced" and (e["n_differ"] or e["reported"] != version))
                    or (e["event"] == "failed" and e["reported"] is not None) for e in readers)
        t.mixed += mixed
        if silent:
            t.hangs += 1
            kind = "hang"
        elif len(readers) == READERS and all(e["event"] == "synced" and not e["n_differ"] for e in readers):
            t.completed += 1
            kind = "completed"
            self.sync_seconds.append(max(e["seconds"] for e in readers))
            if self.fault_pending:
                t.recovered += 1
                self.fault_pending = False
                for fault in t.fault_log:
                    if not fault["recovered"]:
                        fault["recovered"], fault["after_versions"] = True, version - fault["version"]
        elif not mixed:
            t.failed_clean += 1
            kind = "failed_clean"
        else:
            kind = "mixed"
        cut = next((f for f in t.fault_log if not f["recovered"] and f["kind"] in ("link_flap", "long_cut")), None)
        t.restarted_for_cut += len(silent) if cut is not None else 0
        for worker in silent:
            print(f"soak: {worker.key} silent on version {version}: {self.job.stderr(worker.key)[-500:]}", file=sys.stderr)
            self.replace(worker, version)
        return {"outcome": kind, "mixed": mixed, "silent": [w.key for w in silent],
                "seconds": round(max((e.get("seconds", 0.0) for e in readers), default=0.0), 3),
                "errors": sorted({e["error"][:160] for e in readers if e["event"] == "failed"})}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--syncs", type=int, default=100, help="versions to sync (K)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault draws")
    parser.add_argument("--fault-rate", type=float, default=0.25, help="chance of a fault per sync")
    parser.add_argument("--rate", type=float, default=10.0,
                        help="every link's rate, Mbit/s (10: a sync takes ~0.3 s, so faults land while it runs)")
    parser.add_argument("--timeout", type=float, default=5.0, help="the workers' sync and release timeout, s")
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="stop (and say so) past this wall time")
    parser.add_argument("--max-cut", type=float, default=60.0, help="the longest a long cut lasts, s")
    parser.add_argument("--compute", type=float, default=0.5,
                        help="each trainer's training step between publish and release, s (its agent polled meanwhile)")
    parser.add_argument("--smoke", action="store_true",
                        help="12 syncs: a link flap, a kill and restart, a slow link, a long cut of a reader's node and "
                             "of a trainer's, and a reader's cut past 3 publishes (each cut just over twice the timeout)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.syncs, args.max_seconds = 12, min(args.max_seconds, 400.0)
        args.max_cut = min(args.max_cut, 2 * args.timeout + 3)
    if args.syncs < 1 or not 0 <= args.fault_rate <= 1 or args.rate <= 0 or args.timeout <= 0:
        raise SystemExit("soak: --syncs must be >= 1, --fault-rate in [0, 1], --rate and --timeout positive")
    began = time.monotonic()
    versions = list(range(1, args.syncs + 1))
    stopped = None
    with tempfile.TemporaryDirectory(prefix="weightplan-soak-") as tmp:
        tmp = Path(tmp)
        plan = compile_tiny_plan(tmp)
        nodes = {"s0": None, **{f"t{r}": args.rate for r in range(TRAINERS)}, **{f"i{k}": args.rate for k in range(READERS)}}
        try:
            with EmulatedCluster(nodes, tag="wpsoak") as cluster, \
                    Job(tmp, plan, "soak", cluster=cluster, store_node="s0") as job:
                soak = Soak(job, cluster, args, versions)
                for worker in soak.workers:
                    soak.start(worker, versions)
                for worker in soak.workers:
                    job.event(worker.key, "ready" if worker.role == "trainer" else "joined", timeout=300)
                version = versions[0]
                while version <= versions[-1]:
                    if time.monotonic() - began > args.max_seconds:
                        stopped = f"time bound {args.max_seconds:g} s reached after {version - 1} syncs"
                        break
                    driven = soak.sync(version)
                    for outcome in soak.tally.outcomes[-driven:]:
                        print(json.dumps(outcome), file=sys.stderr, flush=True)
                    version += driven
        except EmulatedClusterError as exc:  # no root, no iproute2, a leftover namespace, a node that never came back
            raise SystemExit(f"soak: {exc}") from None
    t = soak.tally
    print(json.dumps({"syncs": t.syncs, "completed": t.completed, "failed_clean": t.failed_clean, "mixed": t.mixed,
                      "hangs": t.hangs, "recovered": t.recovered, "faults": t.faults, "longest_cut_s": t.longest_cut_s,
                      "restarted_for_cut": t.restarted_for_cut, "fault_log": t.fault_log,
                      "seconds": round(time.monotonic() - began, 1), "seed": args.seed, "stopped": stopped}))


if __name__ == "__main__":
    main()
