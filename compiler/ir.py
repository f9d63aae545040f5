"""Op-chain IR: frozen nodes recorded by the tracer, strided geometry, copies and byte runs."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from weightplan.runtime.layout.shards import ShardLayout, TrainerLayout
from weightplan.runtime.plan.columns import BlockSpans, Runs, StageRuns
from weightplan.runtime.plan.header import InferenceHeader, PlanStats, QuantLayout, SourceChoice, TrainerHeader
from weightplan.runtime.plan.schema import DTYPE_SIZES, DerivedItem, Fanout, TensorEntry


class Op(str, enum.Enum):
    """The small set of value-level ops every recorded aten op is canonicalised to."""

    SOURCE = "source"  # args: (trainer tensor name,)
    SLICE = "slice"  # args: (dim, start, length, step); narrow, split, chunk lower to it
    SELECT = "select"  # args: (dim, index); unbind lowers to it
    PERMUTE = "permute"  # args: (dims,); transpose and t lower to it
    RESHAPE = "reshape"  # args: (shape,); view, squeeze, unsqueeze, flatten lower to it
    EXPAND = "expand"  # args: (shape,)
    CONTIGUOUS = "contiguous"  # args: (); clone and contiguous: identity on values
    CAST = "cast"  # args: (dtype name,)
    MAP = "map"  # args: (step name,); an elementwise step of runtime/casts.py (exp, neg, scale:<float>), in the input's dtype
    CAT = "cat"  # args: (dim,); one input per concatenated tensor
    CONSTANT = "constant"  # args: (value,); no inputs: a fill_, zero_ or copy_ of a constant into a destination


@dataclass(frozen=True)
class Node:
    """One recorded op: its canonical args, its inputs, and the shape/dtype of its value."""

    op: Op
    args: tuple
    inputs: tuple["Node", ...]
    shape: tuple[int, ...]
    dtype: str

    def sources(self) -> tuple[str, ...]:
        """Trainer tensor names this value reads, in first-use order."""
        if self.op is Op.SOURCE:
            return (self.args[0],)
        seen: dict[str, None] = {}
        for node in self.inputs:
            for name in node.sources():
                seen.setdefault(name)
        return tuple(seen)

    def render(self) -> str:
        """A one-line, deterministic text form used by the plan printer and errors."""
        if self.op is Op.SOURCE:
            return f"{self.args[0]}"
        inner = ", ".join(node.render() for node in self.inputs)
        args = ", ".join(_render_arg(a) for a in self.args)
        return f"{self.op.value}({inner}{', ' if args else ''}{args})"


def _render_arg(arg) -> str:
    if isinstance(arg, tuple):
        return "[" + ",".join(str(a) for a in arg) + "]"
    return str(arg)


@dataclass(frozen=True)
class Geometry:
    """A strided region of a flat buffer, in elements: offset + sum(index[d] * strides[d])."""

    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @staticmethod
    def contiguous(shape: tuple[int, ...], offset: int = 0) -> "Geometry":
        strides = []
        step = 1
        for size in reversed(shape):
            strides.append(step)
            step *= size
        return Geometry(offset, tuple(shape), tuple(reversed(strides)))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """(starts, ends) of the contiguous element stretches this region covers, ascending if strides are positive."""
        if self.numel == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        dims = sorted((d for d, n in enumerate(self.shape) if n != 1), key=lambda d: -self.strides[d])
        shape, strides = [self.shape[d] for d in dims], [self.strides[d] for d in dims]
        length = 1
        while shape and strides[-1] == length:  # trailing dims that continue each other form one stretch
            length *= shape.pop()
            strides.pop()
        starts = np.array([self.offset], dtype=np.int64)
        for n, stride in zip(shape, strides):
            starts = (starts[:, None] + np.arange(n, dtype=np.int64)[None, :] * stride).reshape(-1)
        return starts, starts + length


@dataclass(frozen=True)
class Assignment:
    """A traced `copy_`: the value `node` is written into `geometry` of destination `dest`."""

    dest: str
    geometry: Geometry
    node: Node
    loading: str  # checkpoint tensor whose load produced it (for messages)


@dataclass(frozen=True)
class Fill:
    """A folded constant assignment: every element of dest[geometry] becomes `value` (cast to dest's dtype).

    `order` is its position among the rank's assignments: where fills overlap, the later one wins,
    and copies always come after the fills they overlap (the tracer refuses the reverse).
    """

    dest: str
    geometry: Geometry
    value: float | int | bool
    order: int
    loading: str


@dataclass(frozen=True)
class Constants:
    """Constant writes as parallel arrays, in elements: dests[dest[i]][dst_off[i] :+length[i]] = values[i].

    They never go on the wire: each inference rank holding the destination writes them itself.
    """

    dest: np.ndarray
    dst_off: np.ndarray
    length: np.ndarray
    values: tuple

    @staticmethod
    def empty() -> "Constants":
        return Constants(*(np.zeros(0, dtype=np.int64) for _ in range(3)), ())

    def __len__(self) -> int:
        return int(self.length.shape[0])

    def take(self, index: np.ndarray) -> "Constants":
        return Constants(self.dest[index], self.dst_off[index], self.length[index],
                         tuple(self.values[i] for i in np.asarray(index).tolist()))

    @staticmethod
    def concat(parts: list["Constants"]) -> "Constants":
        if not parts:
            return Constants.empty()
        return Constants(*(np.concatenate([getattr(p, f) for p in parts]).astype(np.int64) for f in ("dest", "dst_off", "length")),
                         tuple(v for p in parts for v in p.values))


@dataclass(frozen=True)
class Copy:
    """A folded assignment: elementwise src[src_geom] -> dst[dst_geom], casting through `casts`."""

    src: str
    src_geom: Geometry
    dest: str
    dst_geom: Geometry
    casts: tuple[str, ...]  # dtypes the value passes through: source dtype first, destination dtype last


@dataclass(frozen=True)
class LayerReuse:
    """Decoder layer `member` loads exactly as the traced layer `template` does, its index renamed
    (frontend/layer_classes.py; a traced guard layer of the class checks it)."""

    template: int
    member: int


@dataclass(frozen=True)
class PlanOrigin:
    """What the plan header says about where it came from: versions, model, and the two layouts."""

    vllm_version: str
    model: str
    config_sha256: str
    architecture: str
    trainer: TrainerHeader
    inference: InferenceHeader  # without `unloaded`: the program's own table
    quant: str
    src_ranks: int
    dst_ranks: int


@dataclass(frozen=True)
class QuantTarget:
    """A bf16 tensor vLLM's loaders write and its post-load step quantizes into an fp8 weight and a scale."""

    staging: str
    weight: str
    scale: str
    padding: tuple[tuple[int, int], ...] = ()  # element ranges the post-load step sets to zero


@dataclass(frozen=True)
class Coverage:
    """How much of the destination bytes the runs and constants write exactly once (what verify proves)."""

    dst_bytes: int
    written_once_bytes: int  # by runs or constants, counted once per inference rank holding the tensor
    uncovered: tuple[str, ...]  # destination tensors with bytes nobody writes
    first_gap: str = ""  # the first unwritten byte range of uncovered[0], for messages
    constant_bytes: int = 0  # of written_once_bytes, those constants write (never on the wire)

    @property
    def fraction(self) -> float:
        return self.written_once_bytes / self.dst_bytes if self.dst_bytes else 1.0


@dataclass(frozen=True)
class Program:
    """What passes transform: tensor tables plus assignments, then copies, then runs.

    Besides the tables, passes share typed facts: the trainer layout split_shards cuts by (and the
    shard sizes it derives, which verify bounds reads by), the tensors vLLM quantizes and where
    place_quant quantizes their blocks, and what the plan header records.
    """

    sources: tuple[TensorEntry, ...]
    dests: tuple[TensorEntry, ...]
    assignments: tuple[Assignment, ...] = ()
    copies: tuple[Copy, ...] = ()
    runs: Runs | None = None
    cast_chains: tuple[tuple[str, ...], ...] = ()
    fills: tuple[Fill, ...] = ()
    constants: Constants = field(default_factory=Constants.empty)
    last_writes: Mapping[str, str] = field(default_factory=dict, compare=False)  # dest name -> its last traced write, described
    layer_reuse: tuple[LayerReuse, ...] = ()  # layers whose runs expand_layers derives from their template's
    origin: PlanOrigin | None = None
    trainer_layout: ShardLayout | TrainerLayout | None = None  # None is one rank holding every tensor whole
    shard_numel: np.ndarray | None = field(default=None, compare=False)  # [trainer rank, source], set by split_shards
    quant_targets: tuple[QuantTarget, ...] = ()
    quant_placement: QuantPlacement | None = field(default=None, compare=False)  # set by place_quant
    kernel_layout: QuantLayout | None = field(default=None, compare=False)  # how vLLM's fp8 kernels want weights and scales
    derived: tuple[DerivedItem, ...] = ()  # post-load state the receiver derives
    unloaded: tuple[TensorEntry, ...] = ()  # parameters vLLM's load never writes (frontend/unloaded.py), not in dests
    coverage: Coverage | None = field(default=None, compare=False)  # set by check_coverage
    source_choice: SourceChoice | None = field(default=None, compare=False)  # set by split_shards
    gpus_per_node: int = 0  # --inference gpus-per-node (0: no node-local fan-out)
    fanout: Fanout | None = field(default=None, compare=False)  # set by place_fanout
    stats: PlanStats = field(default=PlanStats(), compare=False)  # compile statistics the header records

    def source_index(self) -> dict[str, int]:
        return {spec.name: i for i, spec in enumerate(self.sources)}

    def dest_index(self) -> dict[str, int]:
        return {spec.name: i for i, spec in enumerate(self.dests)}

    def quantized(self) -> dict[str, QuantTarget]:
        """The quant targets by the bf16 destination name vLLM's loaders write."""
        return {t.staging: t for t in self.quant_targets}


def itemsize(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {sorted(DTYPE_SIZES)}") from None


@dataclass(frozen=True)
class QuantPlacement:
    """Where each 128x128 block of each quantized tensor is quantized (fp8_per_block), as parallel arrays.

    `staging` rows: (name, shape, ranks, weight dest index, scale dest index); the bf16 tensor
    vLLM's loaders write before process_weights_after_loading. Stage runs (`stage_*`, in
    elements) copy trainer shard bytes into a staging tensor (sides: runtime/plan/schema.py `Side`):
    SENDER on the trainer rank itself (into its arena, never on the wire), RECEIVER pulled by the
    receivers, GATHER read by trainer `quant_rank` from its peer `src_rank` (or copied locally when
    they are equal). Spans cover flat block ids [first, first + count) (matrix, block row, block col
    order): SENDER and GATHER quantized by trainer `src_rank` and served as fp8, RECEIVER by each
    receiver from its staging.
    """

    staging: tuple[tuple, ...]
    stage: StageRuns
    spans: BlockSpans
