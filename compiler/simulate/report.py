"""simulate-plan's report: the prediction as one JSON object or as text (a jinja2 template)."""

from __future__ import annotations

from pathlib import Path

import jinja2

from weightplan.runtime.plan.format import Plan
from .cluster import Cluster, ClusterError, load_cluster
from .model import Prediction

SHIPPED = Path(__file__).resolve().parent / "clusters"

TEXT = jinja2.Template(
    """\
predicted sync on {{ c.name }} (a model, not a measurement): {{ "%.3f" | format(p.sync_s) }} s
  plan            {{ plan.header.model }}, trainer {{ plan.header.trainer.token }} ({{ plan.header.src_ranks }} ranks) -> inference {{ plan.header.inference.token }} ({{ plan.header.dst_ranks }} ranks), quant {{ plan.header.quant }}
  cluster         NIC {{ c.nic_gbytes_per_s }} GB/s x {{ c.nics_per_gpu }} per GPU, intra-node {{ c.intra_node_gbytes_per_s }} GB/s, {{ c.descriptor_us }} us per descriptor, quantizer {{ c.sender_quant_gbytes_per_s }} / {{ c.receiver_quant_gbytes_per_s }} GB/s (sender / receiver){% if c.wire_efficiency != 1.0 or c.read_latency_us %}, wire efficiency {{ c.wire_efficiency }}, read latency {{ c.read_latency_us }} us{% endif %}
  bytes per inference NIC  max {{ "%.3f" | format(d.inference_nic_bytes.max / 1e9) }} GB, mean {{ "%.3f" | format(d.inference_nic_bytes.mean / 1e9) }} GB{% if plan.fanout %} (first hops, from the trainers){% endif %}
{% if d.second_hop_bytes is defined %}  second hops     {{ "%.3f" | format(d.second_hop_bytes.max / 1e9) }} GB max, {{ "%.3f" | format(d.second_hop_bytes.mean / 1e9) }} GB mean per inference GPU from its node's pullers (gpus-per-node {{ plan.fanout.gpus_per_node }}); one puller serves at most {{ "%.3f" | format(d.second_hop_bytes.served_max / 1e9) }} GB
{% endif %}{% if d.delta is defined %}  delta sync      density {{ d.delta.density }}: wire ratio {{ "%.4f" | format(d.delta.wire_ratio) }} (of {{ "%.3f" | format(d.delta.full_inference_nic_bytes_max / 1e9) }} GB full per inference NIC), encode {{ d.delta.encode_gbytes_per_s }} GB/s of page bytes per trainer, apply {{ d.delta.apply_gbytes_per_s }} GB/s of delta bytes per inference GPU; second hops full
{% endif %}{% if node_stages %}  per node        bytes from the trainers per inference node (its pipeline stages): {% for node, n in d.inference_node_bytes.items() %}{{ node }} {{ "%.3f" | format(n / 1e9) }} GB ({{ node_stages[node] }}){% if not loop.last %}, {% endif %}{% endfor %}
{% endif %}  phases end      {% for k, v in d.phase_end_s.items() %}{{ k }} {{ "%.4f" | format(v) }} s{% if not loop.last %}, {% endif %}{% endfor %}
  NIC busy        mean {{ "%.3f" | format(d.nic_busy_mean) }}; busiest {% for b in d.busiest_nics %}{{ b.nic }} {{ "%.3f" | format(b.busy) }}{% if not loop.last %}, {% endif %}{% endfor %}
  critical path
{% for s in d.critical_path %}    {{ "%-18s" | format(s.phase) }} {{ s.task }} ({{ s.rank }}), limited by {{ s.limited_by }}: {{ "%.4f" | format(s.start_s) }} -> {{ "%.4f" | format(s.end_s) }} s
{% endfor %}""",
    undefined=jinja2.StrictUndefined,
)


def resolve_cluster(text: str) -> Cluster:
    """A cluster file path, or the name of a shipped one (compiler/simulate/clusters/<name>.json)."""
    shipped = SHIPPED / f"{text}.json"
    if Path(text).is_file() or "/" in text or text.endswith(".json"):
        return load_cluster(text)
    if not shipped.is_file():
        names = ", ".join(sorted(p.stem for p in SHIPPED.glob("*.json")))
        raise ClusterError(f"no cluster file {text!r} and no shipped cluster of that name (shipped: {names})")
    return load_cluster(shipped)


def render_text(plan: Plan, cluster: Cluster, prediction: Prediction) -> str:
    return TEXT.render(p=prediction, d=prediction.as_dict(), c=cluster, plan=plan, node_stages=node_stages(plan, prediction.inference_nodes))


def node_stages(plan: Plan, inference_nodes: tuple[str, ...]) -> dict[str, str]:
    """For a pipelined inference layout, the pipeline stages of each inference node ("stage 0", "stages 0-1") given each
    inference rank's node; else {}."""
    inference = plan.header.inference
    if not inference.pp:
        return {}
    stages: dict[str, list[int]] = {}
    for rank, node in enumerate(inference_nodes):
        stages.setdefault(node, []).append(inference.rank_coords(rank).pp)
    return {node: f"stage {min(s)}" if min(s) == max(s) else f"stages {min(s)}-{max(s)}" for node, s in stages.items()}
