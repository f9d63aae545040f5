"""`make soak`: K syncs over emulated nodes with faults injected at random points from a fixed seed; last line JSON.

Nodes (testing/emulated_cluster.py, UCX over TCP): the store on s0 (a TCPStore; with --rendezvous etcd, three etcd
members from the system's etcd binary, one on each of e0, e1 and e2, and the workers given
`etcd://<e0>:2379,<e1>:2379,<e2>:2379`), trainer ranks 0 and 1 on t0 and t1, inference ranks 0 and 1 on i0 and i1
(with --pool, pool replicas 2 and 3 on i2 and i3), every worker's link at --rate Mbit/s (the store's links
unlimited). The workers are testing/runtime_worker.py processes (a tiny Qwen3-MoE plan, fsdp=2 -> dp=2,ep; with
--pool tiny Llama, fsdp=2 -> dp=2; every reader compares its bytes with the host executor's), gated
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
- slow link: a node's link drops to a tenth of --rate for that sync;
- trainers restarted (`trainers_restarted`): every trainer process is SIGKILLed at once; new ones (new incarnations)
  start after that sync and take the following versions while the readers keep running (a TCPStore on s0 is no
  trainer's, so it survives);
- etcd member killed (`etcd_member_killed`, --rendezvous etcd): one of the three members is SIGKILLed, and restarted
  on its data directory after that sync (the soak waits until all three answer healthy, so the next draw has three);
- etcd member cut (`etcd_member_cut`, --rendezvous etcd): the node of the member the workers talk to (the first of
  their address, e0, until a fault of that member made them fail over to the next) is cut off for 1 s to twice the
  workers' timeout, then back (the soak waits until all three members answer healthy);
- replica joined / left (`replica_joined`, `replica_left`, with --pool): a reader process of a free pool slot starts
  while the sync runs and joins (its Receiver starts) once that sync is over, taking the following versions as a DP
  replica beyond the plan's ranks (`pool_ranks`, runtime/tables/ranks.py); or a joined replica is told to leave and
  closes its Receiver (Receiver.close()) before the next version, which must complete without it. A pool replica
  needs a DP-only plan: expert parallel plans refuse `pool_ranks`, so --pool syncs tiny Llama, fsdp=2 -> dp=2 with
  pool_ranks 4, not the default Qwen3-MoE plan, fsdp=2 -> dp=2,ep.

- experts rearranged (`experts_rearranged`, with --eplb): before the sync, vLLM's own EPLB policy
  (`DefaultEplbPolicy.rebalance_experts`, random loads from the soak's seed) makes a new physical-to-logical table,
  written where the readers look (testing/eplb.py); each reader makes a Receiver on it (as the vLLM backend does after
  vLLM's balancer moved experts) and checks every slot holds the expert the table puts there. --eplb syncs the
  checked-in EPLB plan (tiny Qwen3-MoE, fsdp=2 -> dp=2,ep,eplb=2, compiled by vLLM's CUDA build) instead.
The kinds drawn are all that apply to the run (the etcd ones with --rendezvous etcd, the replica ones with --pool), or
those --faults lists (each listed kind once, in a random order, before any is drawn again; a replica kind there
implies --pool, an EPLB kind --eplb).

A sync is `completed` when every reader synced it with the reference bytes, `failed_clean` when some reader failed
it with a SyncError and reported no version, a `hang` when some process said nothing within the bound (4 x the
workers' timeout + 10 s; the silent process is then replaced). `mixed` counts readers that reported a version whose
bytes differ from the reference (must be 0), `recovered` the faults after which a later sync (before the next fault)
completed. Per fault, `fault_log` says which node or process, how long a cut lasted, whether a later sync (before the
next fault) completed (`recovered`) and after how many versions (`after_versions`: 0 is the sync it hit, 1 the next
version; a replica's join or leave counts from the sync it took effect after); a process
the soak had to replace for a cut (a hang) is in `restarted_for_cut` (must be 0), and every reader process it had to
replace other than the ones a kill or leave fault itself ended is in `engines_restarted` (must be 0). The soak stops
early, saying so, past --max-seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from weightplan.testing.emulated_cluster import EmulatedCluster, EmulatedClusterError
from weightplan.testing.runtime_harness import Job

MODEL = ROOT / "tests" / "configs" / "tiny-qwen3-moe"
POOL_MODEL = ROOT / "tests" / "configs" / "tiny-llama"  # dense: a DP-only plan, which pool replicas can copy
TRAINERS, READERS, POOL = 2, 2, 4  # with --pool, inference ranks 2 and 3 are replicas that join and leave
FAULTS = ("link_flap", "long_cut", "cut_past_publish", "kill_restart", "slow_link", "trainers_restarted")
ETCD_FAULTS = ("etcd_member_killed", "etcd_member_cut")
POOL_FAULTS = ("replica_joined", "replica_left")
EPLB_FAULTS = ("experts_rearranged",)
KINDS = FAULTS + ETCD_FAULTS + POOL_FAULTS + EPLB_FAULTS
# --eplb: the checked-in plan vLLM's CUDA build compiled for tiny Qwen3-MoE, fsdp=2 -> dp=2,ep,eplb=2
EPLB_PLAN = ROOT / "tests" / "runtime" / "data" / "tiny-qwen3-moe-eplb2.plan"
ETCD_MEMBERS, ETCD_CLIENT_PORT, ETCD_PEER_PORT = 3, 2379, 2380
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
    faults: dict = field(default_factory=dict)  # kind -> how many, for every kind the run draws
    outcomes: list = field(default_factory=list)
    fault_log: list = field(default_factory=list)  # per fault: what, where, and whether and when a sync completed after it
    longest_cut_s: float = 0.0
    restarted_for_cut: int = 0  # processes replaced because they hung after a link cut
    engines_restarted: int = 0  # reader processes replaced for a hang (not the ones a kill or leave fault ended)


def compile_tiny_plan(out: Path, pool: bool = False) -> Path:
    """The soak's plan: tiny Qwen3-MoE, fsdp=2 -> dp=2,ep; with `pool`, tiny Llama, fsdp=2 -> dp=2 (DP only)."""
    from weightplan.compiler.compile import CompileOptions, compile_plan

    path = out / "soak.plan"
    if pool:
        compile_plan(CompileOptions(str(POOL_MODEL), "hf", "bf16", "none", path, trainer=f"fsdp={TRAINERS}",
                                    inference=f"dp={READERS}"))
    else:
        compile_plan(CompileOptions(str(MODEL), "stacked", "bf16", "none", path, trainer=f"fsdp={TRAINERS}",
                                    inference=f"dp={READERS},ep"))
    return path


_HEALTHY = ("import json, sys, time, urllib.request\n"
            "deadline = time.monotonic() + float(sys.argv[1])\n"
            "def healthy(url):\n"
            "    try:\n"
            "        with urllib.request.urlopen(url + '/health', timeout=1) as answer:\n"
            "            return json.loads(answer.read()).get('health') == 'true'\n"
            "    except (OSError, ValueError):\n"
            "        return False\n"
            "while not all(healthy(url) for url in sys.argv[2:]):\n"
            "    if time.monotonic() > deadline:\n"
            "        sys.exit(1)\n"
            "    time.sleep(0.1)\n")


class EtcdMembers:
    """Three etcd members, one on each of the nodes `nodes`, with data directories under `root`."""

    def __init__(self, cluster: EmulatedCluster, root: Path, nodes: list[str]):
        self.etcd = shutil.which("etcd")
        if self.etcd is None:
            raise SystemExit("soak: --rendezvous etcd needs the etcd binary on PATH (Debian: apt-get install etcd-server)")
        self.cluster, self.root, self.nodes = cluster, root, nodes
        self.hosts = [cluster.address(node) for node in nodes]
        self.procs: list[subprocess.Popen | None] = [None] * len(nodes)
        self.restarts = 0
        for member in range(len(nodes)):
            self.start(member)
        self.wait_healthy(120)

    @property
    def address(self) -> str:
        return "etcd://" + ",".join(f"{host}:{ETCD_CLIENT_PORT}" for host in self.hosts)

    def start(self, member: int) -> None:
        """Start (or restart, on its data directory) member `member`."""
        initial = ",".join(f"m{i}=http://{host}:{ETCD_PEER_PORT}" for i, host in enumerate(self.hosts))
        host = self.hosts[member]
        log = open(self.root / f"etcd-m{member}.log", "a")
        self.procs[member] = self.cluster.popen(self.nodes[member], [
            self.etcd, "--name", f"m{member}", "--data-dir", str(self.root / f"etcd-m{member}"),
            "--listen-client-urls", f"http://{host}:{ETCD_CLIENT_PORT}",
            "--advertise-client-urls", f"http://{host}:{ETCD_CLIENT_PORT}",
            "--listen-peer-urls", f"http://{host}:{ETCD_PEER_PORT}",
            "--initial-advertise-peer-urls", f"http://{host}:{ETCD_PEER_PORT}",
            "--initial-cluster", initial, "--initial-cluster-token", "weightplan-soak", "--log-level", "error"],
            stdout=log, stderr=subprocess.STDOUT)

    def kill(self, member: int) -> None:
        self.procs[member].kill()
        self.procs[member].wait()

    def restart(self, member: int) -> None:
        self.restarts += 1
        self.start(member)
        self.wait_healthy(120)

    def wait_healthy(self, timeout: float) -> None:
        """Until every member answers healthy (a leader elected, the member in it), asked from e0's node."""
        urls = [f"http://{host}:{ETCD_CLIENT_PORT}" for host in self.hosts]
        done = self.cluster.run(self.nodes[0], [sys.executable, "-c", _HEALTHY, str(timeout), *urls], timeout=timeout + 30)
        if done.returncode != 0:
            logs = (self.root / "etcd-m0.log").read_text()[-1000:]
            raise EmulatedClusterError(f"the etcd members were not all healthy within {timeout:g} s: {logs}")


class Soak:
    """Drives the job version by version, injecting faults and tallying outcomes."""

    def __init__(self, job: Job, cluster: EmulatedCluster, args, versions: list[int]):
        self.job, self.cluster, self.args, self.versions = job, cluster, args, versions
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.kinds = kinds(args)
        self.tally.faults = {kind: 0 for kind in self.kinds}
        self.workers = [Worker("trainer", r, f"t{r}", f"tr{r}") for r in range(TRAINERS)] + \
                       [Worker("inference", k, f"i{k}", f"inf{k}") for k in range(READERS)]
        self.spawned = {w.key: 0 for w in self.workers}  # per rank, processes started beyond the first (key suffix)
        self.etcd: EtcdMembers | None = None  # set by main with --rendezvous etcd
        self.etcd_current = 0  # the member the workers talk to: the first of their address, until it failed them
        self.bound = 4 * args.timeout + 10
        self.fault_pending = False  # a fault happened and no sync has completed since
        self.long_cuts = 0  # long cuts alternate between a trainer's node and a reader's
        self.past_publish_cuts = 0
        self.sync_seconds: list[float] = []  # the slowest reader's time of each completed sync

    def start(self, worker: Worker, versions: list[int], start_gate: bool = False) -> None:
        extra = (("--wait-joined", "--busy-after-publish", str(self.args.compute)) if worker.role == "trainer"
                 else ("--plain", "--leave-gate", *(("--start-gate",) if start_gate else ()),
                       *(("--expert-maps", str(self.job.gates)) if self.args.eplb else ())))
        pool = ("--pool-ranks", str(POOL)) if self.args.pool else ()
        self.job.start(worker.key, worker.role, worker.rank, "--versions", ",".join(map(str, versions)), "--gate",
                       "--timeout", str(self.args.timeout), *pool, *extra, node=worker.node)

    def next_key(self, base: str) -> str:
        """A key no process of this rank had: `base`, then `base.1`, `base.2`, ..."""
        n = self.spawned.get(base)
        self.spawned[base] = 0 if n is None else n + 1
        return base if n is None else f"{base}.{n + 1}"

    def replace(self, worker: Worker, after: int) -> None:
        """A new process (new incarnation) for `worker`, taking the versions after `after`."""
        if self.job.procs[worker.key].poll() is None:
            self.job.kill(worker.key)
        worker.restarts += 1
        worker.key = self.next_key(worker.key.split('.')[0])
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
        elif self.rng.random() < self.args.fault_rate:
            usable = [k for k in self.kinds if self.usable(k, version)]
            if self.args.faults:  # each listed kind once before any again
                usable = [k for k in usable if not self.tally.faults.get(k)] or usable
            kind = self.rng.choice(usable) if usable else None
        else:
            kind = None
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
        elif kind == "trainers_restarted":
            worker = Worker("trainer", -1, ",".join(w.node for w in self.trainers()),
                            ",".join(w.key for w in self.trainers()))
        elif kind in ETCD_FAULTS:
            member = self.rng.randrange(ETCD_MEMBERS) if kind == "etcd_member_killed" else self.etcd_current
            worker = Worker("etcd", member, self.etcd.nodes[member], f"m{member}")
        elif kind == "replica_joined":
            rank = self.rng.choice(self.free_slots())
            worker = Worker("inference", rank, f"i{rank}", self.next_key(f"inf{rank}"))
        elif kind == "replica_left":
            worker = self.rng.choice(self.replicas())
        elif kind == "experts_rearranged":  # every reader follows the new table
            readers = [w for w in self.workers if w.role == "inference"]
            worker = Worker("inference", -1, ",".join(w.node for w in readers), ",".join(w.key for w in readers))
        else:
            worker = self.rng.choice(self.workers)
        typical = sorted(self.sync_seconds[-10:])[len(self.sync_seconds[-10:]) // 2] if self.sync_seconds else 0.5
        return kind, worker, worker.key, self.rng.uniform(0.0, 0.8 * typical)  # while the sync runs

    def run(self, began: float) -> str | None:
        """Start every worker, then drive every version; what stopped the soak early, or None."""
        for worker in self.workers:
            self.start(worker, self.versions)
        for worker in self.workers:
            self.job.event(worker.key, "ready" if worker.role == "trainer" else "joined", timeout=300)
        version = self.versions[0]
        while version <= self.versions[-1]:
            if time.monotonic() - began > self.args.max_seconds:
                return f"time bound {self.args.max_seconds:g} s reached after {version - 1} syncs"
            driven = self.sync(version)
            for outcome in self.tally.outcomes[-driven:]:
                print(json.dumps(outcome), file=sys.stderr, flush=True)
            version += driven
        return None

    def trainers(self) -> list[Worker]:
        return [w for w in self.workers if w.role == "trainer"]

    def replicas(self) -> list[Worker]:
        return [w for w in self.workers if w.role == "inference" and w.rank >= READERS]

    def free_slots(self) -> list[int]:
        return sorted(set(range(READERS, POOL)) - {w.rank for w in self.replicas()})

    def usable(self, kind: str, version: int) -> bool:
        """Whether a fault of `kind` can be drawn before `version`: a replica joins into a free pool slot with a version
        left to take, and leaves if one joined."""
        return {"replica_joined": bool(self.free_slots()) and version < self.versions[-1],
                "replica_left": bool(self.replicas())}.get(kind, True)

    def probe(self) -> tuple[str, int]:
        """Where a node whose link came back must connect again: the TCPStore, or the etcd member the workers use."""
        if self.etcd is not None:
            return self.etcd.hosts[self.etcd_current], ETCD_CLIENT_PORT
        host, port = self.job.address.rsplit(":", 1)
        return host, int(port)

    def sync(self, version: int) -> int:
        """Drive `version` (and, for a cut past publishing, the versions published during the cut); returns how many."""
        fault = self.draw_fault(version)
        if fault is not None and fault[0] == "cut_past_publish":
            return self.cut_past_publish(version, fault[1])
        killed: list[Worker] = []
        if fault is not None and fault[0] == "experts_rearranged":  # vLLM's balancer moved experts before this sync
            from weightplan.runtime import load_plan
            from weightplan.testing.eplb import vllm_rebalanced, write_table

            write_table(self.job.gates, version, vllm_rebalanced(load_plan(EPLB_PLAN), self.rng.randrange(1 << 30)))
        self.job.go(version)
        if fault is not None:
            kind, worker, _, delay = fault
            self.tally.faults[kind] = self.tally.faults.get(kind, 0) + 1
            if kind not in POOL_FAULTS:  # a replica joins or leaves once this sync is over (pending from then)
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
                killed = [worker]
            elif kind == "trainers_restarted":
                killed = self.trainers()
                for trainer in killed:  # at once: no trainer outlives another
                    self.job.procs[trainer.key].kill()
                for trainer in killed:
                    self.job.procs[trainer.key].wait()
            elif kind == "etcd_member_killed":
                self.etcd.kill(worker.rank)
            elif kind == "etcd_member_cut":
                cut = self.rng.uniform(1.0, max(1.0, 2 * self.args.timeout))
                self.cluster.link_down(worker.node)
                time.sleep(cut)
                self.cluster.link_up(worker.node)
                self.etcd_current = (worker.rank + 1) % ETCD_MEMBERS  # a worker that asked meanwhile failed over
                self.tally.fault_log.append({"version": version, "kind": kind, "node": worker.node, "member": worker.key,
                                             "cut_s": round(cut, 1), "recovered": False, "after_versions": None})
            elif kind == "replica_joined":  # the process starts now; its Receiver joins once this sync is over
                self.start(worker, [v for v in self.versions if v > version], start_gate=True)
            elif kind == "replica_left":
                (self.job.gates / f"leave-{worker.rank}").touch()
            elif kind == "experts_rearranged":
                pass  # the table was written before the go gate
            else:
                self.cluster.set_rate(worker.node, self.args.rate / 10)
            if kind not in ("link_flap", "long_cut", "etcd_member_cut", *POOL_FAULTS):
                self.tally.fault_log.append({"version": version, "kind": kind, "node": worker.node, "worker": worker.key,
                                             "recovered": False, "after_versions": None})
        outcome = self.collect(version, killed)
        if fault is not None:
            kind, worker, _, _ = fault
            if kind in ("link_flap", "long_cut"):
                self.cluster.wait_reachable(worker.node, *self.probe(), timeout=30)
            elif kind == "slow_link":
                self.cluster.set_rate(worker.node, self.args.rate)
            elif kind == "kill_restart":
                self.replace(worker, version)
            elif kind == "trainers_restarted":
                for trainer in killed:
                    self.replace(trainer, version)
            elif kind == "etcd_member_killed":
                self.etcd.restart(worker.rank)
                if worker.rank == self.etcd_current:
                    self.etcd_current = (worker.rank + 1) % ETCD_MEMBERS
            elif kind == "etcd_member_cut":
                self.etcd.wait_healthy(60)
                for trainer in self.trainers():
                    self.cluster.wait_reachable(trainer.node, *self.probe(), timeout=30)
            elif kind == "replica_joined":
                self.job.start_readers()
                self.job.event(worker.key, "joined", timeout=180)
                (self.job.gates / "start-0").unlink()
                self.workers.append(worker)  # the next sync completes only if it synced too
            elif kind == "replica_left":
                self.job.event(worker.key, "left", timeout=self.bound)
                self.job.wait(worker.key, timeout=60)
                (self.job.gates / f"leave-{worker.rank}").unlink()
                self.workers.remove(worker)  # the next sync completes without it
            if kind in POOL_FAULTS:
                self.fault_pending = True
                self.tally.fault_log.append({"version": version, "kind": kind, "node": worker.node, "worker": worker.key,
                                             "recovered": False, "after_versions": None})
        self.tally.outcomes.append({"version": version, "fault": fault and [fault[0], fault[2]], **outcome})
        return 1

    def cut_past_publish(self, version: int, worker: Worker) -> int:
        """Cut `worker`'s node right before `version`; the trainers publish it and the next PAST_PUBLISH - 1 versions,
        then idle until the cut is over; returns the versions driven (the cut reader must sync the one after)."""
        t = self.tally
        t.faults["cut_past_publish"] = t.faults.get("cut_past_publish", 0) + 1
        low = 2 * self.args.timeout + 3
        cut = self.args.max_cut if self.past_publish_cuts == 0 else self.rng.uniform(low, max(low, self.args.max_cut))
        self.past_publish_cuts += 1
        self.fault_pending = True
        self.cluster.link_down(worker.node)
        cut_at = time.monotonic()
        for v in range(version, version + PAST_PUBLISH):
            self.job.go(v)
            outcome = self.collect(v, [])
            self.tally.outcomes.append({"version": v, "fault": ["cut_past_publish", worker.key] if v == version else None,
                                        **outcome})
        time.sleep(max(0.0, cut - (time.monotonic() - cut_at)))  # the trainers idle, alive, while the cut lasts
        self.cluster.link_up(worker.node)
        cut = time.monotonic() - cut_at
        t.longest_cut_s = max(t.longest_cut_s, round(cut, 1))
        t.fault_log.append({"version": version, "kind": "cut_past_publish", "node": worker.node, "cut_s": round(cut, 1),
                            "published_during_cut": PAST_PUBLISH, "recovered": False, "after_versions": None})
        self.cluster.wait_reachable(worker.node, *self.probe(), timeout=30)
        return PAST_PUBLISH

    def collect(self, version: int, killed: list[Worker]) -> dict:
        """Wait for every live worker's outcome of `version`; classify the sync."""
        t = self.tally
        t.syncs += 1
        deadline = time.monotonic() + self.bound
        results, silent = {}, []
        for worker in self.workers:
            if worker in killed:
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
        elif len(readers) == sum(w.role == "inference" for w in self.workers) and all(e["event"] == "synced" and not e["n_differ"] for e in readers):
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
        cut = next((f for f in t.fault_log if not f["recovered"]
                    and f["kind"] in ("link_flap", "long_cut", "etcd_member_cut")), None)
        t.restarted_for_cut += len(silent) if cut is not None else 0
        t.engines_restarted += sum(w.role == "inference" for w in silent)
        for worker in silent:
            print(f"soak: {worker.key} silent on version {version}: {self.job.stderr(worker.key)[-500:]}", file=sys.stderr)
            self.replace(worker, version)
        return {"outcome": kind, "mixed": mixed, "silent": [w.key for w in silent],
                "seconds": round(max((e.get("seconds", 0.0) for e in readers), default=0.0), 3),
                "errors": sorted({e["error"][:160] for e in readers if e["event"] == "failed"})}


def kinds(args) -> tuple[str, ...]:
    """The fault kinds this run draws: --faults, or every kind that applies to its rendezvous and pool."""
    if args.faults:
        return tuple(args.faults)
    return (FAULTS + (ETCD_FAULTS if args.rendezvous == "etcd" else ()) + (POOL_FAULTS if args.pool else ())
            + (EPLB_FAULTS if args.eplb else ()))


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
    parser.add_argument("--rendezvous", choices=("tcpstore", "etcd"), default="tcpstore",
                        help="the workers' store: a TCPStore on node s0, or three etcd members on e0, e1 and e2")
    parser.add_argument("--pool", action="store_true",
                        help=f"a DP-only plan (tiny Llama, fsdp=2 -> dp=2) with pool_ranks {POOL}: replicas join and leave")
    parser.add_argument("--eplb", action="store_true",
                        help="sync the checked-in EPLB plan (tiny Qwen3-MoE, fsdp=2 -> dp=2,ep,eplb=2): experts rearrange")
    parser.add_argument("--faults", type=lambda s: [k.strip() for k in s.split(",") if k.strip()], default=None,
                        help=f"comma-separated kinds to draw (default: all that apply), of {','.join(KINDS)}")
    args = parser.parse_args(argv)
    for kind in args.faults or ():
        if kind not in KINDS:
            raise SystemExit(f"soak: unknown fault kind {kind!r} (known: {', '.join(KINDS)})")
        if kind in ETCD_FAULTS and args.rendezvous != "etcd":
            raise SystemExit(f"soak: fault {kind} needs --rendezvous etcd")
    args.pool = args.pool or any(kind in POOL_FAULTS for kind in args.faults or ())
    args.eplb = args.eplb or any(kind in EPLB_FAULTS for kind in args.faults or ())
    if args.pool and args.eplb:
        raise SystemExit("soak: --pool and --eplb do not go together: pool replicas need a DP-only plan, EPLB an "
                         "expert-parallel one")
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
        plan = EPLB_PLAN if args.eplb else compile_tiny_plan(tmp, args.pool)
        stores = [f"e{m}" for m in range(ETCD_MEMBERS)] if args.rendezvous == "etcd" else ["s0"]
        nodes = {**{node: None for node in stores}, **{f"t{r}": args.rate for r in range(TRAINERS)},
                 **{f"i{k}": args.rate for k in range(POOL if args.pool else READERS)}}
        try:
            with EmulatedCluster(nodes, tag="wpsoak" if args.rendezvous == "tcpstore" else "wpsoake") as cluster:
                etcd = EtcdMembers(cluster, tmp, stores) if args.rendezvous == "etcd" else None
                with Job(tmp, plan, "soak", cluster=cluster, store_node="s0", address=etcd and etcd.address) as job:
                    soak = Soak(job, cluster, args, versions)
                    soak.etcd = etcd
                    try:
                        stopped = soak.run(began)
                    except AssertionError as exc:  # a process the soak started (a replica, a replacement) never said
                        soak.tally.hangs += 1      # it joined: a hang, and the run stops there, naming it
                        stopped = f"stopped at a hang: {str(exc).splitlines()[0]}"
        except EmulatedClusterError as exc:  # no root, no iproute2, a leftover namespace, a node that never came back
            raise SystemExit(f"soak: {exc}") from None
    t = soak.tally
    print(json.dumps({"syncs": t.syncs, "completed": t.completed, "failed_clean": t.failed_clean, "mixed": t.mixed,
                      "hangs": t.hangs, "recovered": t.recovered, "faults": t.faults, "longest_cut_s": t.longest_cut_s,
                      "restarted_for_cut": t.restarted_for_cut, "engines_restarted": t.engines_restarted,
                      "fault_log": t.fault_log,
                      "seconds": round(time.monotonic() - began, 1), "seed": args.seed, "stopped": stopped}))


if __name__ == "__main__":
    main()
