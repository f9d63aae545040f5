"""The cluster file: nodes, GPUs, NICs and link rates, costs, and where the ranks sit (schema, validation, placement)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from weightplan.runtime.errors import WeightplanError
from weightplan.runtime.files import read_json_file

RATES = ("nic_gbytes_per_s", "intra_node_gbytes_per_s", "sender_quant_gbytes_per_s", "receiver_quant_gbytes_per_s")
REQUIRED = ("name", "nodes", "trainer", "inference", "nics_per_gpu", *RATES, "descriptor_us")
# Optional network behaviour (defaults: an ideal NIC): the payload share of a NIC's line rate (TCP/IP headers per
# frame) and a fixed time before a reader's bytes from one trainer flow (protocol round trips, READ requests).
NETWORK = ("wire_efficiency", "read_latency_us")
# Optional delta-sync costs (needed only to model a delta sync): page bytes a trainer diffs and encodes per second,
# and delta bytes a receiver decodes and writes into its destinations per second.
DELTA_RATES = ("delta_encode_gbytes_per_s", "delta_apply_gbytes_per_s")
OPTIONAL = ("description", "sources", *NETWORK, *DELTA_RATES)
# Bounds that keep every predicted time a sane float: rates from 1 MB/s to 1 PB/s, a descriptor from 0 to 1 s.
RATE_RANGE = (1e-3, 1e6)
DESCRIPTOR_US_RANGE = (0.0, 1e6)
WIRE_EFFICIENCY_RANGE = (0.01, 1.0)
READ_LATENCY_US_RANGE = (0.0, 1e7)
MAX_COUNT = 4096  # nodes in a group, GPUs per node, NICs per GPU


class ClusterError(WeightplanError):
    """A cluster file is unreadable, misses a field, or has a field of the wrong type or range."""


@dataclass(frozen=True)
class NodeGroup:
    name: str
    count: int
    gpus_per_node: int


@dataclass(frozen=True)
class Cluster:
    """Rates are GB/s (1e9 bytes) per GPU and direction: `nic` is one NIC (a GPU has `nics_per_gpu`),
    `intra_node` its share of the node's fast link (NVLink; cma between processes here), the quant
    rates bf16 bytes in per second. A descriptor costs `descriptor_us` of its NICs' time. Trainer
    ranks fill the GPUs of node group `trainer` in order, inference ranks those of `inference`
    (after the trainers' when both name the same group). Rank order is each side's own: a pipelined
    trainer's stages are contiguous rank blocks (TrainerHeader.stage_of), and inference ranks are
    numbered dp, then pp, then tp (RankCoords), as vLLM fills nodes, so tp=8,pp=2 on 8-GPU nodes puts
    each pipeline stage on a node of its own."""

    name: str
    groups: tuple[NodeGroup, ...]
    trainer: str
    inference: str
    nics_per_gpu: int
    nic_gbytes_per_s: float
    intra_node_gbytes_per_s: float
    sender_quant_gbytes_per_s: float
    receiver_quant_gbytes_per_s: float
    descriptor_us: float
    wire_efficiency: float = 1.0  # payload bytes per line-rate byte on a NIC (TCP over Ethernet at MTU 1500: 0.956)
    read_latency_us: float = 0.0  # before a read's bytes flow, once its trainer published (0: none)
    delta_encode_gbytes_per_s: float | None = None  # page bytes diffed and encoded per second per trainer GPU
    delta_apply_gbytes_per_s: float | None = None  # delta bytes decoded and applied per second per inference GPU
    description: str = ""
    sources: tuple[tuple[str, str], ...] = ()

    def group(self, name: str) -> NodeGroup:
        return next(g for g in self.groups if g.name == name)

    def gpus(self, name: str) -> int:
        g = self.group(name)
        return g.count * g.gpus_per_node

    def nodes_of(self, trainer_ranks: int, inference_ranks: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The node (`group/index`) of every trainer rank and every inference rank, in rank order; ClusterError if they do
        not fit."""
        first_free = {g.name: 0 for g in self.groups}
        out = []
        for side, group, ranks in (("trainer", self.trainer, trainer_ranks), ("inference", self.inference, inference_ranks)):
            g = self.group(group)
            start = first_free[group]
            if start + ranks > self.gpus(group):
                raise ClusterError(f"cluster {self.name!r}: the plan has {ranks} {side} ranks but node group {group!r} "
                                   f"has {self.gpus(group) - start} free GPUs ({g.count} nodes x {g.gpus_per_node})")
            out.append(tuple(f"{group}/{(start + r) // g.gpus_per_node}" for r in range(ranks)))
            first_free[group] = start + ranks
        return out[0], out[1]

    @property
    def nic_bytes_per_s(self) -> float:
        """Payload bytes per second through one GPU's NICs."""
        return self.nics_per_gpu * self.nic_gbytes_per_s * 1e9 * self.wire_efficiency


def load_cluster(path: Path | str) -> Cluster:
    """Read and validate a cluster file (JSON); every problem is one ClusterError naming the field."""
    path = Path(path)
    return parse_cluster(read_json_file(path, ClusterError, "cluster file"), str(path))


def parse_cluster(data, where: str = "cluster") -> Cluster:
    if not isinstance(data, dict):
        raise ClusterError(f"{where}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ClusterError(f"{where}: unknown field {unknown[0]!r}; fields are {', '.join(REQUIRED + OPTIONAL)}")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ClusterError(f"{where}: missing field {missing[0]!r}")
    name = _string(data, "name", where)
    groups = _groups(data["nodes"], where)
    sides = {side: _string(data, side, where) for side in ("trainer", "inference")}
    for side, group in sides.items():
        if group not in {g.name for g in groups}:
            raise ClusterError(f"{where}: field {side!r} names node group {group!r}, which 'nodes' does not define")
    sources = data.get("sources", {})
    if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
        raise ClusterError(f"{where}: field 'sources' must map field names to text saying where each value came from")
    return Cluster(
        name=name, groups=groups, trainer=sides["trainer"], inference=sides["inference"],
        nics_per_gpu=_integer(data, "nics_per_gpu", where, data["nics_per_gpu"]),
        **{k: _number(data, k, where, RATE_RANGE) for k in RATES},
        descriptor_us=_number(data, "descriptor_us", where, DESCRIPTOR_US_RANGE),
        wire_efficiency=_number(data, "wire_efficiency", where, WIRE_EFFICIENCY_RANGE) if "wire_efficiency" in data else 1.0,
        read_latency_us=_number(data, "read_latency_us", where, READ_LATENCY_US_RANGE) if "read_latency_us" in data else 0.0,
        **{k: _number(data, k, where, RATE_RANGE) for k in DELTA_RATES if k in data},
        description=_string(data, "description", where) if "description" in data else "",
        sources=tuple(sorted(sources.items())),
    )


def _string(data: dict, key: str, where: str) -> str:
    value = data[key]
    if not isinstance(value, str) or not value:
        raise ClusterError(f"{where}: field {key!r} must be a non-empty string, got {value!r}")
    return value


def _number(data: dict, key: str, where: str, bounds: tuple[float, float]) -> float:
    value = data[key]
    low, high = bounds
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ClusterError(f"{where}: field {key!r} must be a number in {low:g}..{high:g}, got {str(value)[:40]}")
    return float(value)


def _integer(data: dict, key: str, where: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
        raise ClusterError(f"{where}: field {key!r} must be an integer in 1..{MAX_COUNT}, got {str(value)[:40]}")
    return value


def _groups(nodes, where: str) -> tuple[NodeGroup, ...]:
    if not isinstance(nodes, dict) or not nodes:
        raise ClusterError(f"{where}: field 'nodes' must map node group names to {{\"count\": N, \"gpus_per_node\": G}}")
    out = []
    for name, spec in nodes.items():
        field = f"nodes.{name}"
        if not isinstance(spec, dict) or set(spec) != {"count", "gpus_per_node"}:
            raise ClusterError(f"{where}: field {field!r} must be {{\"count\": N, \"gpus_per_node\": G}}, got {spec!r}")
        out.append(NodeGroup(name, _integer(spec, f"{field}.count", where, spec["count"]),
                             _integer(spec, f"{field}.gpus_per_node", where, spec["gpus_per_node"])))
    return tuple(out)
