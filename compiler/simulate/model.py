"""The sync-time model: a plan's transfers and quantization as tasks on a cluster's NICs, links and quantizers."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from weightplan.runtime.delta.pages import PAGE_BYTES
from .cluster import Cluster
from .delta import DeltaModelError, DeltaSync
from .fair_share import Resource, Schedule, Task, simulate
from .transfers import PlanTransfers

PHASES = ("gather", "sender-quantize", "sender-encode", "read", "receiver-apply", "receiver-quantize", "second-hop")


@dataclass(frozen=True)
class Prediction:
    cluster: str
    sync_s: float
    resources: tuple[Resource, ...]
    tasks: tuple[Task, ...]
    schedule: Schedule
    critical_path: tuple[dict, ...]
    nic_busy: dict  # NIC resource name -> busy fraction of the sync
    phase_end_s: dict  # phase -> when its last task finished ("second-hop" only in a plan with fan-out)
    inference_bytes: np.ndarray  # bytes each inference rank reads from the trainers (first hops)
    second_hop_bytes: np.ndarray | None = None  # fan-out: [puller, peer] bytes read whole from the node's puller
    delta: dict | None = None  # a delta sync: its density, wire ratio and the cluster's encode and apply rates
    inference_nodes: tuple[str, ...] = ()  # the cluster node of each inference rank

    def as_dict(self, top: int = 5) -> dict:
        busy = sorted(self.nic_busy.items(), key=lambda kv: (-round(kv[1], 9), _natural(kv[0])))
        return {
            "cluster": self.cluster,
            "sync_s": self.sync_s,
            "phase_end_s": self.phase_end_s,
            "critical_path": list(self.critical_path),
            "nic_busy": self.nic_busy,
            "busiest_nics": [{"nic": k, "busy": v} for k, v in busy[:top]],
            "nic_busy_mean": float(np.mean(list(self.nic_busy.values()))) if self.nic_busy else 0.0,
            "inference_nic_bytes": {"max": int(self.inference_bytes.max(initial=0)),
                                    "mean": float(self.inference_bytes.mean()) if len(self.inference_bytes) else 0.0},
            "inference_node_bytes": self.node_bytes(),
            "tasks": len(self.tasks),
            "events": self.schedule.events,
            **({} if self.second_hop_bytes is None else {"second_hop_bytes": _second_hop_figures(self.second_hop_bytes)}),
            **({} if self.delta is None else {"delta": self.delta}),
        }

    def node_bytes(self) -> dict[str, int]:
        """Bytes each inference node receives from the trainers (first hops), nodes in rank order."""
        out: dict[str, int] = {}
        for node, nbytes in zip(self.inference_nodes, self.inference_bytes.tolist()):
            out[node] = out.get(node, 0) + int(nbytes)
        return out

    def timeline(self, ranks: int = 8) -> list[dict]:
        """Lanes for the ranks on the critical path, then the inference ranks whose NIC was busiest (up
        to `ranks`); in each lane one bar per phase from its first task's start to its last task's end."""
        lanes = list(dict.fromkeys(step["rank"] for step in self.critical_path))
        for _, name in sorted(((-round(v, 9), _natural(k)), k) for k, v in self.nic_busy.items()
                              if k.startswith("inference ") and k.endswith(" in")):
            label = name.split(" NIC")[0].split(" link")[0]
            if len(lanes) >= ranks:
                break
            if label not in lanes:
                lanes.append(label)
        rows = []
        for label in lanes[:ranks]:
            phases: dict[str, dict] = {}
            for i, t in enumerate(self.tasks):
                if label not in (t.rank, t.name.split(" -> ")[0]):
                    continue
                bar = phases.setdefault(t.phase, {"phase": t.phase, "start": float(self.schedule.start[i]),
                                                  "end": float(self.schedule.finish[i]), "tasks": 0})
                bar["start"] = min(bar["start"], float(self.schedule.start[i]))
                bar["end"] = max(bar["end"], float(self.schedule.finish[i]))
                bar["tasks"] += 1
            busy = max((v for k, v in self.nic_busy.items() if k.startswith(label + " ")), default=0.0)
            rows.append({"rank": label, "busy": busy, "bars": [phases[p] for p in PHASES if p in phases]})
        return rows


def _second_hop_figures(hops: np.ndarray) -> dict:
    """Bytes each inference rank reads from its node's pullers (max, mean) and the most one rank serves to its peers."""
    read, served = hops.sum(axis=0), hops.sum(axis=1)
    return {"max": int(read.max(initial=0)), "mean": float(read.mean()) if len(read) else 0.0,
            "served_max": int(served.max(initial=0)), "total": int(hops.sum())}


def _natural(name: str) -> tuple:
    """'inference 10 NIC in' after 'inference 9 NIC in'."""
    return tuple(int(w) if w.isdigit() else w for w in name.split())


def predict(transfers: PlanTransfers, cluster: Cluster, delta: DeltaSync | None = None) -> Prediction:
    """Simulate one sync: gathers between trainer ranks, then each trainer's quantization (serial on
    its quantizer), then every trainer -> inference read once its trainer published, then each
    inference rank's own quantization once all its reads landed; with fan-out, then every second hop
    (a peer reading whole entries from its node's puller, over the node's link) once that puller's
    reads and quantization all finished (the runtime's per-sync "landed" flag) and so did the peer's own
    (the runtime reads second hops after its own first hop landed).

    With `delta`, every trainer rank diffs and encodes all the pages it serves after its quantization (before it
    publishes), each read carries the delta's share of its bytes (receiver-side stage copies stay whole) with at most
    one descriptor per page plus the page index, each inference rank decodes and applies what it read before its own
    quantization, and second hops stay full (as in the runtime)."""
    n_src, n_dst = transfers.read_bytes.shape
    ratio = 0.0
    if delta is not None:
        if cluster.delta_encode_gbytes_per_s is None or cluster.delta_apply_gbytes_per_s is None:
            raise DeltaModelError(f"cluster {cluster.name!r} has no delta_encode_gbytes_per_s and delta_apply_gbytes_per_s: "
                                  "a delta sync cannot be modelled on it")
        ratio = delta.wire_ratio(transfers.unit_bytes or {})
    trainer_nodes, inference_nodes = cluster.nodes_of(n_src, n_dst)
    resources: list[Resource] = []
    index: dict[str, int] = {}

    def res(name: str, rate: float) -> int:
        if name not in index:
            index[name] = len(resources)
            resources.append(Resource(name, rate))
        return index[name]

    nic, link = cluster.nic_bytes_per_s, cluster.intra_node_gbytes_per_s * 1e9
    per_descriptor = cluster.descriptor_us * 1e-6
    tasks: list[Task] = []

    def move(phase: str, src: str, src_node: str, dst: str, dst_node: str, nbytes: float, descriptors: float, after=()) -> int:
        same = src_node == dst_node
        rate = link if same else nic
        kind = "link" if same else "NIC"
        path = (res(f"{src} {kind} out", rate), res(f"{dst} {kind} in", rate))
        tasks.append(Task(f"{src} -> {dst}", phase, dst, nbytes + descriptors * per_descriptor * rate, path, tuple(after)))
        return len(tasks) - 1

    gathers: dict[int, list[int]] = {q: [] for q in range(n_src)}
    for s, q in zip(*np.nonzero(transfers.gather_bytes)):
        gathers[int(q)].append(move("gather", f"trainer {s}", trainer_nodes[s], f"trainer {q}", trainer_nodes[q],
                                    float(transfers.gather_bytes[s, q]), float(transfers.gather_descriptors[s, q])))
    published: dict[int, tuple[int, ...]] = {}
    for t in range(n_src):
        if transfers.sender_quant_bytes[t] > 0:
            tasks.append(Task(f"trainer {t} quantize", "sender-quantize", f"trainer {t}", float(transfers.sender_quant_bytes[t]),
                              (res(f"trainer {t} quantizer", cluster.sender_quant_gbytes_per_s * 1e9),), tuple(gathers[t])))
            published[t] = (len(tasks) - 1,)
        else:
            published[t] = tuple(gathers[t])
        if delta is not None and transfers.served_bytes[t] > 0:
            tasks.append(Task(f"trainer {t} encode", "sender-encode", f"trainer {t}", float(transfers.served_bytes[t]),
                              (res(f"trainer {t} encoder", cluster.delta_encode_gbytes_per_s * 1e9),), published[t]))
            published[t] = (len(tasks) - 1,)
    stage_read = transfers.stage_read_bytes if transfers.stage_read_bytes is not None else np.zeros_like(transfers.read_bytes)
    applied = np.zeros(n_dst)
    landed: dict[int, list[int]] = {i: [] for i in range(n_dst)}
    for t, i in zip(*np.nonzero(transfers.read_bytes)):
        after = published[int(t)]
        if cluster.read_latency_us > 0:  # a pure delay: a task of that many seconds on a resource of its own
            tasks.append(Task(f"trainer {t} -> inference {i} latency", "read", f"inference {i}", cluster.read_latency_us * 1e-6,
                              (res(f"trainer {t} -> inference {i} latency", 1.0),), after))
            after = (len(tasks) - 1,)
        nbytes, descriptors = float(transfers.read_bytes[t, i]), float(transfers.read_descriptors[t, i])
        if delta is not None:
            whole = float(stage_read[t, i])
            applied[i] += (nbytes - whole) * ratio
            descriptors = min(descriptors, np.ceil((nbytes - whole) / PAGE_BYTES)) + 1
            nbytes = whole + (nbytes - whole) * ratio
        landed[int(i)].append(move("read", f"trainer {t}", trainer_nodes[t], f"inference {i}", inference_nodes[i],
                                   nbytes, descriptors, after))
    first_hops_done: dict[int, tuple[int, ...]] = {}
    for i in range(n_dst):
        if applied[i] > 0:
            tasks.append(Task(f"inference {i} apply", "receiver-apply", f"inference {i}", float(applied[i]),
                              (res(f"inference {i} decoder", cluster.delta_apply_gbytes_per_s * 1e9),), tuple(landed[i])))
            landed[i] = [len(tasks) - 1]
        if transfers.receiver_quant_bytes[i] > 0:
            tasks.append(Task(f"inference {i} quantize", "receiver-quantize", f"inference {i}", float(transfers.receiver_quant_bytes[i]),
                              (res(f"inference {i} quantizer", cluster.receiver_quant_gbytes_per_s * 1e9),), tuple(landed[i])))
            first_hops_done[i] = (len(tasks) - 1,)
        else:
            first_hops_done[i] = tuple(landed[i])
    hops = transfers.second_hop_bytes
    if hops is not None:  # over the node's link (the NICs if the cluster puts puller and peer on different nodes)
        for p, i in zip(*np.nonzero(hops)):
            move("second-hop", f"inference {p}", inference_nodes[p], f"inference {i}", inference_nodes[i], float(hops[p, i]),
                 float(transfers.second_hop_descriptors[p, i]), first_hops_done[int(p)] + first_hops_done[int(i)])
    schedule = simulate(resources, tasks)
    sync = schedule.makespan
    nic_busy = {r.name: (float(schedule.busy[k] / sync) if sync else 0.0)
                for k, r in enumerate(resources) if " NIC " in r.name or " link " in r.name}
    optional = {"second-hop": hops is not None, "sender-encode": delta is not None, "receiver-apply": delta is not None}
    phase_end = {p: float(max((schedule.finish[i] for i, t in enumerate(tasks) if t.phase == p), default=0.0))
                 for p in PHASES if optional.get(p, True)}
    read = transfers.read_bytes if delta is None else stage_read + (transfers.read_bytes - stage_read) * ratio
    summary = None if delta is None else {
        "density": delta.density, "wire_ratio": ratio, "encode_gbytes_per_s": cluster.delta_encode_gbytes_per_s,
        "apply_gbytes_per_s": cluster.delta_apply_gbytes_per_s, "full_inference_nic_bytes_max": float(transfers.read_bytes.sum(axis=0).max(initial=0))}
    return Prediction(cluster.name, sync, tuple(resources), tuple(tasks), schedule, _critical_path(tasks, resources, schedule),
                      nic_busy, phase_end, read.sum(axis=0), hops, summary, tuple(inference_nodes))


def _critical_path(tasks: list[Task], resources: list[Resource], schedule: Schedule) -> tuple[dict, ...]:
    """From the last task to finish back through the dependency that finished last before it started."""
    if not tasks:
        return ()
    path = []
    i = int(np.argmax(schedule.finish))
    while True:
        t = tasks[i]
        path.append({"phase": t.phase, "task": t.name, "rank": t.rank, "limited_by": resources[schedule.limited_by[i]].name,
                     "start_s": float(schedule.start[i]), "end_s": float(schedule.finish[i])})
        if not t.after:
            break
        i = max(t.after, key=lambda j: schedule.finish[j])
    return tuple(reversed(path))
