"""The plan header as typed records: PlanHeader's one JSON reader (validating) and writer, and the fingerprint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field

from ..casts import CHAIN_RULE, is_chain
from ..errors import PlanFormatError
from ..fp8.rounding import SCALE_ROUNDINGS, ScaleRounding
from ..layout.placements import Box
from ..layout.shards import MAX_RANKS, RankBoxes
from .schema import DTYPE_SIZES, ConstantRun, Quant, DerivedItem, Fanout, StagingEntry, TensorEntry

MAX_ELEMENTS = 1 << 48  # elements in one tensor, and any offset, length or stride a plan stores
MAX_DIMS = 8
MAX_ROWS = 1 << 28  # rows of any one column table (about 2 GB per int64 column)
QUANTS = tuple(q.value for q in Quant)
SOURCE_CHOICE_METHODS = ("flow", "greedy")
KIND = "weightplan"
FORMAT_VERSION = 6  # the newest format this reads: 6 adds node-local fan-out, 5 the constants table
CONSTANTS_FORMAT_VERSION = 5  # plans with constants and no fan-out
BASE_FORMAT_VERSION = 4  # plans without constants or fan-out are written as format 4, which readers of format 4 read alike


def _field(*, fingerprinted: bool = False, optional: bool = False, **kwargs):
    """A header field. The fingerprint covers the `fingerprinted` ones; an `optional` one is left out of the JSON while it
    holds its default, so plans without it keep their bytes and fingerprints."""
    return field(metadata={"fingerprinted": fingerprinted, "optional": optional}, **kwargs)


@dataclass(frozen=True)
class TrainerHeader:
    """The trainer side: checkpoint format and dtype, the layout's token, and per box class the box each trainer rank
    holds (a source's `box_class` indexes `boxes`); `adapter` names a --trainer-adapter; `pp` the pipeline stages of a
    pipelined trainer (stage s: trainer ranks s * src_ranks / pp onwards; absent: one stage)."""

    format: str
    dtype: str
    token: str
    boxes: tuple[RankBoxes, ...]
    adapter: str | None = _field(optional=True, default=None)
    pp: int | None = _field(optional=True, default=None)

    def stage_of(self, rank: int, src_ranks: int) -> int:
        """The pipeline stage trainer `rank` belongs to (0 for a trainer without stages)."""
        return rank // (src_ranks // (self.pp or 1))

    def to_json(self) -> dict:
        boxes = [[None if b is None else [list(r) for r in b] for b in table] for table in self.boxes]
        return {"format": self.format, "dtype": self.dtype, "token": self.token, "boxes": boxes,
                **({"adapter": self.adapter} if self.adapter is not None else {}), **({"pp": self.pp} if self.pp else {})}

    @staticmethod
    def from_json(obj, src_ranks: int, fail) -> "TrainerHeader":
        _check_keys(obj, TrainerHeader, "trainer", fail)
        text = {key: _str(obj, key, "trainer", fail) for key in ("format", "dtype", "token")}
        adapter = _str(obj, "adapter", "trainer", fail) if "adapter" in obj else None
        pp = _int(obj, "pp", 2, MAX_RANKS, "trainer", fail) if "pp" in obj else None
        if pp is not None and src_ranks % pp:
            fail("trainer.pp", f"is {pp}, which does not divide the {src_ranks} trainer ranks")
        boxes = obj["boxes"]
        if not isinstance(boxes, list) or not all(isinstance(c, list) and len(c) == src_ranks for c in boxes):
            fail("trainer.boxes", "is not a list of per-rank box tables, one box (or null) per trainer rank")
        for i, table in enumerate(boxes):
            for box in table:
                if box is not None and not (isinstance(box, list) and len(box) <= MAX_DIMS and all(
                        isinstance(r, list) and len(r) == 2 and _count(r[0], MAX_ELEMENTS) and _count(r[1], MAX_ELEMENTS)
                        and r[0] <= r[1] for r in box)):
                    fail(f"trainer.boxes[{i}]", f"holds {str(box)[:60]}, not a list of [start, stop) ranges")
        return TrainerHeader(**text, boxes=tuple(tuple(None if b is None else _box(b) for b in table) for table in boxes),
                             adapter=adapter, pp=pp)


@dataclass(frozen=True)
class DraftHeader:
    """A speculative-decoding draft's plan: the draft method and the parameters it leaves to the target's plan."""

    method: str
    shared_with_target: tuple[str, ...]

    def to_json(self) -> dict:
        return {"method": self.method, "shared_with_target": list(self.shared_with_target)}

    @staticmethod
    def from_json(obj, fail) -> "DraftHeader":
        _check_keys(obj, DraftHeader, "inference.draft", fail)
        shared = obj["shared_with_target"]
        if not isinstance(shared, list) or not all(isinstance(name, str) for name in shared):
            fail("inference.draft.shared_with_target", "is not a list of parameter names")
        return DraftHeader(_str(obj, "method", "inference.draft", fail), tuple(shared))


@dataclass(frozen=True)
class RankCoords:
    """A vLLM worker's place in the layout: its TP rank, pipeline rank and DP rank."""

    tp: int
    pp: int
    dp: int

    @staticmethod
    def of(rank: int, tp: int, pp: int) -> "RankCoords":
        """The coordinates of global inference rank `rank`, numbered as vLLM numbers workers: dp, then pp, then tp."""
        return RankCoords(rank % tp, rank // tp % pp, rank // (tp * pp))

    def rank(self, tp: int, pp: int) -> int:
        """The global inference rank at these coordinates (the inverse of `of`)."""
        return (self.dp * pp + self.pp) * tp + self.tp


@dataclass(frozen=True)
class LoraHeader:
    """A LoRA adapter's plan: PEFT rank and alpha, the engine's max_lora_rank the slot buffers are sized for, and the
    PEFT target modules; its destinations are one slot of vLLM's `lora_{a,b}_stacked` buffers (docs/lora.md)."""

    rank: int
    alpha: float
    max_rank: int
    targets: tuple[str, ...]

    def to_json(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "max_rank": self.max_rank, "targets": list(self.targets)}

    @staticmethod
    def from_json(obj, fail) -> "LoraHeader":
        _check_keys(obj, LoraHeader, "inference.lora", fail)
        rank, max_rank = (_int(obj, key, 1, 1 << 20, "inference.lora", fail) for key in ("rank", "max_rank"))
        alpha = obj["alpha"]
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            fail("inference.lora.alpha", "is not a finite number")
        targets = obj["targets"]
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
            fail("inference.lora.targets", "is not a list of module names")
        if rank > max_rank:
            fail("inference.lora.rank", f"{rank} is larger than max_rank {max_rank}")
        return LoraHeader(rank, float(alpha), max_rank, tuple(targets))


@dataclass(frozen=True)
class EplbHeader:
    """vLLM's expert load balancer (`--enable-eplb`): `logical_experts` routed experts per MoE layer held in
    `logical_experts + redundant_experts` physical slots, inference rank r holding slots r*L .. r*L+L-1 (L per rank).
    `layers` lists, per MoE layer in vLLM's order (the rows of its physical-to-logical map), the destination tensors
    whose dim 0 is that layer's local physical slot. The plan writes each slot with the logical expert vLLM's initial
    arrangement puts there (slot p < logical_experts: expert p; slot logical_experts + i: expert i mod logical_experts);
    the receiver maps them through the engine's current table (runtime/tables/eplb.py)."""

    logical_experts: int
    redundant_experts: int
    layers: tuple[tuple[str, ...], ...]

    @property
    def physical_experts(self) -> int:
        return self.logical_experts + self.redundant_experts

    @property
    def tensors(self) -> tuple[str, ...]:
        """Every layer's expert tensor names, layer by layer."""
        return tuple(name for layer in self.layers for name in layer)

    def to_json(self) -> dict:
        return {"logical_experts": self.logical_experts, "redundant_experts": self.redundant_experts,
                "layers": [list(names) for names in self.layers]}

    @staticmethod
    def from_json(obj, fail) -> "EplbHeader":
        _check_keys(obj, EplbHeader, "inference.eplb", fail)
        logical = _int(obj, "logical_experts", 1, MAX_ELEMENTS, "inference.eplb", fail)
        redundant = _int(obj, "redundant_experts", 0, MAX_ELEMENTS, "inference.eplb", fail)
        layers = obj["layers"]
        if not isinstance(layers, list) or not layers or not all(
                isinstance(names, list) and names and all(isinstance(n, str) and n for n in names) for names in layers):
            fail("inference.eplb.layers", "is not a list of MoE layers, each a list of destination names")
        names = [n for layer in layers for n in layer]
        if len(set(names)) != len(names):
            fail("inference.eplb.layers", "names a destination in two places")
        return EplbHeader(logical, redundant, tuple(tuple(layer) for layer in layers))


@dataclass(frozen=True)
class InferenceHeader:
    """The inference side: vLLM's parallel layout (and --inference token), the platform and host choices it was traced
    with, the draft it updates, and the parameters vLLM's load never writes (`unloaded`, rows like the dests')."""

    token: str
    tp: int
    dp: int
    ep: bool
    platform: str
    vllm_host: dict[str, str] | None = _field(optional=True, default=None)
    gpus_per_node: int | None = _field(optional=True, default=None)
    draft: DraftHeader | None = _field(optional=True, default=None)
    unloaded: tuple[TensorEntry, ...] = _field(optional=True, default=())
    pp: int | None = _field(optional=True, default=None)  # pipeline ranks (absent: 1)
    lora: LoraHeader | None = _field(optional=True, default=None)
    eplb: EplbHeader | None = _field(optional=True, default=None)

    @property
    def ranks(self) -> int:
        return self.tp * (self.pp or 1) * self.dp

    def rank_coords(self, rank: int) -> RankCoords:
        return RankCoords.of(rank, self.tp, self.pp or 1)

    def to_json(self) -> dict:
        obj = {"token": self.token, "tp": self.tp, "dp": self.dp, "ep": self.ep, "platform": self.platform}
        if self.pp is not None:
            obj["pp"] = self.pp
        if self.vllm_host is not None:
            obj["vllm_host"] = dict(self.vllm_host)
        if self.gpus_per_node is not None:
            obj["gpus_per_node"] = self.gpus_per_node
        if self.draft is not None:
            obj["draft"] = self.draft.to_json()
        if self.unloaded:
            obj["unloaded"] = [e.dest_row() for e in self.unloaded]
        if self.lora is not None:
            obj["lora"] = self.lora.to_json()
        if self.eplb is not None:
            obj["eplb"] = self.eplb.to_json()
        return obj

    @staticmethod
    def from_json(obj, fail) -> "InferenceHeader":
        """Types and ranges only: `unloaded` is read by PlanHeader.from_json, which knows the destinations."""
        _check_keys(obj, InferenceHeader, "inference", fail)
        tp, dp = (_int(obj, key, 1, MAX_RANKS, "inference", fail) for key in ("tp", "dp"))
        if not isinstance(obj["ep"], bool):
            fail("inference.ep", "is not true or false")
        host = obj.get("vllm_host")
        if host is not None and not (isinstance(host, dict) and all(isinstance(v, str) for v in host.values())):
            fail("inference.vllm_host", "is not an object of strings")
        return InferenceHeader(
            _str(obj, "token", "inference", fail), tp, dp, obj["ep"], _str(obj, "platform", "inference", fail), host,
            _int(obj, "gpus_per_node", 1, MAX_RANKS, "inference", fail) if "gpus_per_node" in obj else None,
            DraftHeader.from_json(obj["draft"], fail) if "draft" in obj else None,
            pp=_int(obj, "pp", 2, MAX_RANKS, "inference", fail) if "pp" in obj else None,
            lora=LoraHeader.from_json(obj["lora"], fail) if "lora" in obj else None,
            eplb=EplbHeader.from_json(obj["eplb"], fail) if "eplb" in obj else None)


@dataclass(frozen=True)
class QuantLayout:
    """How vLLM's kernels for the plan's quantization want weights and scales: the kernels, the [rows, cols] of a
    quantization block, the two dtypes, the memory layout ("plain": as the loader wrote them), and how a block scale
    (amax / 448) rounds: as a GPU engine's quantization rounds it ("cuda") or a CPU engine's ("ieee"),
    runtime/fp8/rounding.py. Every quantizing path of the runtime writes the bytes of that one rounding."""

    linear: str
    moe: str
    block: tuple[int, int]
    weight_dtype: str
    scale_dtype: str
    layout: str
    scale_rounding: ScaleRounding

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "block": list(self.block), "scale_rounding": self.scale_rounding.value}

    @staticmethod
    def from_json(obj, fail) -> "QuantLayout | None":
        """None for the empty object of an unquantized plan."""
        if isinstance(obj, dict) and not obj:
            return None
        if isinstance(obj, dict) and "scale_rounding" not in obj:
            fail("quant_layout.scale_rounding", "is missing: the plan was compiled before plans named how their fp8 block "
                 "scales round (a GPU and a CPU round amax / 448 apart); recompile it with compile-plan")
        _check_keys(obj, QuantLayout, "quant_layout", fail)
        block = obj["block"]
        if not (isinstance(block, list) and len(block) == 2 and all(_count(b, MAX_ELEMENTS) and b for b in block)):
            fail("quant_layout.block", f"is {str(block)[:40]}, not the [rows, cols] of a quantization block")
        text = {key: _str(obj, key, "quant_layout", fail) for key in ("linear", "moe", "weight_dtype", "scale_dtype", "layout")}
        rounding = obj["scale_rounding"]
        if rounding not in SCALE_ROUNDINGS:
            fail("quant_layout.scale_rounding", f"is {str(rounding)[:40]!r}, not one of {', '.join(SCALE_ROUNDINGS)}")
        return QuantLayout(**text, block=tuple(block), scale_rounding=ScaleRounding(rounding))


@dataclass(frozen=True)
class SourceChoice:
    """Bytes the trainer ranks serve (once per reading inference rank) under the greedy choice of
    holders for replicated pieces and under the choice split_shards kept (compiler/passes/source_flow.py)."""

    greedy_max: int
    greedy_mean: float
    chosen_max: int
    chosen_mean: float
    shared_bytes: int  # of all served bytes, those several trainer ranks hold
    method: str  # "flow" when the max-flow split is strictly better, else "greedy"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(obj, fail) -> "SourceChoice":
        where = "stats.source_choice"
        _check_keys(obj, SourceChoice, where, fail)
        for key in ("greedy_mean", "chosen_mean"):  # means of bytes served: inspect-plan divides by them
            if not (isinstance(obj[key], float) and math.isfinite(obj[key]) and obj[key] > 0):
                fail(f"{where}.{key}", f"is {str(obj[key])[:40]}, not a positive number")
        counts = {key: _int(obj, key, 0, 1 << 62, where, fail) for key in ("greedy_max", "chosen_max", "shared_bytes")}
        method = _str(obj, "method", where, fail)
        if method not in SOURCE_CHOICE_METHODS:
            fail(f"{where}.method", f"is {method[:40]!r}, not one of {', '.join(SOURCE_CHOICE_METHODS)}")
        return SourceChoice(**counts, greedy_mean=obj["greedy_mean"], chosen_mean=obj["chosen_mean"], method=method)


@dataclass(frozen=True)
class PlanStats:
    """What compile-plan counted (not fingerprinted): assignments traced, runs before coalescing, and, when trainer
    ranks share pieces, the source choice's figures."""

    assignments: int | None = _field(optional=True, default=None)
    runs_before_coalesce: int | None = _field(optional=True, default=None)
    source_choice: SourceChoice | None = _field(optional=True, default=None)

    def to_json(self) -> dict:
        obj = {key: value for key, value in (("assignments", self.assignments),
                                              ("runs_before_coalesce", self.runs_before_coalesce)) if value is not None}
        return obj | ({"source_choice": self.source_choice.to_json()} if self.source_choice is not None else {})

    @staticmethod
    def from_json(obj, fail) -> "PlanStats":
        _check_keys(obj, PlanStats, "stats", fail)
        counts = {key: _int(obj, key, 0, 1 << 62, "stats", fail) for key in ("assignments", "runs_before_coalesce")
                  if key in obj}
        choice = SourceChoice.from_json(obj["source_choice"], fail) if "source_choice" in obj else None
        return PlanStats(**counts, source_choice=choice)


@dataclass(frozen=True)
class PlanHeader:
    """Everything a plan file states besides its run columns: where it came from (vLLM version, model, config), both
    layouts, the quantization, the tensor tables, compile statistics and the column counts.

    `from_json` is the one reader: it refuses a header the writer would not produce, naming the field. `to_json` is the
    one writer. The fingerprint covers the fields marked fingerprinted, with the format version (FINGERPRINT_KEYS).
    The compiler builds a header with zero counts and no fingerprint; `sealed` fills them in when the plan is encoded.
    """

    vllm_version: str = _field(fingerprinted=True)
    model: str = _field(fingerprinted=True)
    config_sha256: str = _field(fingerprinted=True)
    architecture: str = _field()
    trainer: TrainerHeader = _field(fingerprinted=True)
    inference: InferenceHeader = _field(fingerprinted=True)
    quant: str = _field(fingerprinted=True)
    src_ranks: int = _field()
    dst_ranks: int = _field()
    sources: tuple[TensorEntry, ...] = _field(fingerprinted=True)
    dests: tuple[TensorEntry, ...] = _field(fingerprinted=True)
    cast_chains: tuple[tuple[str, ...], ...] = _field(fingerprinted=True)
    staging: tuple[StagingEntry, ...] = _field(fingerprinted=True, default=())
    quant_layout: QuantLayout | None = _field(fingerprinted=True, default=None)  # {} in the JSON when None
    derived: tuple[DerivedItem, ...] = _field(fingerprinted=True, default=())
    stats: PlanStats = _field(default=PlanStats())
    constants: tuple[ConstantRun, ...] = _field(fingerprinted=True, optional=True, default=())  # sorted by (dest, dst_off)
    fanout: Fanout | None = _field(fingerprinted=True, optional=True, default=None)
    n_runs: int = _field(default=0)  # stored run table entries
    n_stage_runs: int = _field(default=0)
    n_spans: int = _field(default=0)
    fingerprint: str = _field(default="")

    @property
    def format_version(self) -> int:
        """6 with a fan-out table, else 5 with constants, else 4: a plan is written in the oldest format that holds it."""
        return FORMAT_VERSION if self.fanout is not None else CONSTANTS_FORMAT_VERSION if self.constants else BASE_FORMAT_VERSION

    def sealed(self, n_runs: int, n_stage_runs: int, n_spans: int) -> "PlanHeader":
        """This header with the column counts of its plan and its fingerprint."""
        counted = dataclasses.replace(self, n_runs=n_runs, n_stage_runs=n_stage_runs, n_spans=n_spans)
        return dataclasses.replace(counted, fingerprint=fingerprint(counted.to_json()))

    def to_json(self) -> dict:
        """The header object the plan file stores (as canonical JSON)."""
        obj = {
            "format_version": self.format_version,
            "kind": KIND,
            "vllm_version": self.vllm_version,
            "model": self.model,
            "config_sha256": self.config_sha256,
            "architecture": self.architecture,
            "trainer": self.trainer.to_json(),
            "inference": self.inference.to_json(),
            "quant": self.quant,
            "src_ranks": self.src_ranks,
            "dst_ranks": self.dst_ranks,
            "sources": [e.source_row() for e in self.sources],
            "dests": [e.dest_row() for e in self.dests],
            "cast_chains": [list(c) for c in self.cast_chains],
            "staging": [e.row() for e in self.staging],
            "quant_layout": self.quant_layout.to_json() if self.quant_layout is not None else {},
            "derived": [d.row() for d in self.derived],
            "stats": self.stats.to_json(),
            "n_runs": self.n_runs,
            "n_stage_runs": self.n_stage_runs,
            "n_spans": self.n_spans,
            "fingerprint": self.fingerprint,
        }
        if self.constants:
            obj["constants"] = [c.row() for c in self.constants]
        if self.fanout is not None:
            obj["fanout"] = self.fanout.row()
        return obj

    @staticmethod
    def from_json(obj, origin: str) -> "PlanHeader":
        """Read a plan file's header object, refusing (PlanFormatError naming the field) a missing, unknown or mistyped
        field, a value out of range or a table that contradicts another; the fingerprint is the caller's to check."""

        def fail(name: str, what: str):
            raise PlanFormatError(f"{origin}: header field {name!r} {what}")

        _check_version(obj, origin)
        _check_keys(obj, PlanHeader, "", fail)
        text = {key: _str(obj, key, "", fail) for key in ("vllm_version", "model", "config_sha256", "architecture", "quant",
                                                          "fingerprint")}
        if text["quant"] not in QUANTS:
            fail("quant", f"is {text['quant']!r}, not one of {', '.join(QUANTS)}")
        src_ranks, dst_ranks = (_int(obj, key, 1, MAX_RANKS, "", fail) for key in ("src_ranks", "dst_ranks"))
        counts = {key: _int(obj, key, 0, MAX_ROWS, "", fail) for key in ("n_runs", "n_stage_runs", "n_spans")}
        inference = InferenceHeader.from_json(obj["inference"], fail)
        if inference.ranks != dst_ranks:
            fail("dst_ranks", f"is {dst_ranks}, but inference tp={inference.tp} x pp={inference.pp or 1} x dp={inference.dp} ranks")
        trainer = TrainerHeader.from_json(obj["trainer"], src_ranks, fail)
        tables = _Tables(obj, dst_ranks, len(trainer.boxes), fail)
        sources = tables.sources(trainer)
        dests = tables.dests()
        unloaded = tables.unloaded(obj["inference"].get("unloaded", []), dests)
        quant_layout = QuantLayout.from_json(obj["quant_layout"], fail)
        if inference.eplb is not None:
            _check_eplb(inference, dst_ranks, dests, fail)
        return PlanHeader(
            trainer=trainer, inference=dataclasses.replace(inference, unloaded=unloaded), src_ranks=src_ranks,
            dst_ranks=dst_ranks, sources=sources, dests=dests, cast_chains=tables.cast_chains(),
            staging=tables.staging(dests, quant_layout), quant_layout=quant_layout, derived=tables.derived(),
            stats=PlanStats.from_json(obj["stats"], fail), constants=tables.constants(), fanout=tables.fanout(len(dests)),
            **text, **counts)


def _check_eplb(inference: InferenceHeader, dst_ranks: int, dests: tuple[TensorEntry, ...], fail) -> None:
    """An EPLB plan: expert parallelism over every rank of one stage, its physical slots split evenly over the ranks,
    and each layer's expert tensors held by every rank with one local slot per row of dim 0."""
    eplb = inference.eplb
    if not inference.ep or (inference.pp or 1) != 1:
        fail("inference.eplb", "needs expert parallelism over one pipeline stage (ep, no pp)")
    if eplb.physical_experts % dst_ranks:
        fail("inference.eplb", f"has {eplb.physical_experts} physical experts, which the {dst_ranks} ranks do not split evenly")
    local = eplb.physical_experts // dst_ranks
    experts = set(eplb.tensors)
    held: dict[str, set[int]] = {}
    for entry in dests:
        held.setdefault(entry.name, set()).update(entry.ranks)
        if entry.name in experts and (not entry.shape or entry.shape[0] != local):
            fail("inference.eplb.layers", f"names {entry.name!r}, whose dim 0 is not the {local} local slots")
    for layer in eplb.layers:
        for name in layer:
            if held.get(name) != set(range(dst_ranks)):
                fail("inference.eplb.layers", f"names {name!r}, which is not a destination of every inference rank")


FINGERPRINT_KEYS = ("format_version", *(f.name for f in dataclasses.fields(PlanHeader) if f.metadata["fingerprinted"]))


def fingerprint(header: dict) -> str:
    """SHA-256 of the fingerprinted keys a header object holds (absent optional ones leave older fingerprints alone)."""
    return hashlib.sha256(canonical_json({key: header[key] for key in FINGERPRINT_KEYS if key in header})).hexdigest()


def canonical_json(obj) -> bytes:
    """Sorted keys, no spaces, ASCII: the bytes the plan file stores and the fingerprint hashes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _check_version(obj, origin: str) -> None:
    """A weightplan header of a format this reads, with exactly the optional tables its format has."""
    if not isinstance(obj, dict):
        raise PlanFormatError(f"{origin}: the header is a JSON {type(obj).__name__}, not an object")
    version = obj.get("format_version")
    if obj.get("kind") != KIND or not isinstance(version, int):
        raise PlanFormatError(f"{origin} has no weightplan header")
    if version > FORMAT_VERSION:
        raise PlanFormatError(
            f"{origin} uses plan format {version}, newer than this weightplan reads ({FORMAT_VERSION}); upgrade weightplan"
        )
    if version < BASE_FORMAT_VERSION:
        raise PlanFormatError(f"{origin} uses old plan format {version}; recompile it with compile-plan")
    if ("fanout" in obj) != (version == FORMAT_VERSION):
        raise PlanFormatError(f"{origin}: format {version} with{'' if 'fanout' in obj else 'out'} a fan-out table")
    if version < FORMAT_VERSION and ("constants" in obj) != (version == CONSTANTS_FORMAT_VERSION):
        raise PlanFormatError(f"{origin}: format {version} with{'' if 'constants' in obj else 'out'} a constants table")


def _check_keys(obj, record, where: str, fail) -> None:
    """`obj` is a JSON object with every field of `record` the JSON must hold and no field `record` lacks."""
    if not isinstance(obj, dict):
        fail(where, "is not an object")
    fields = {f.name: f for f in dataclasses.fields(record)}
    envelope = ("format_version", "kind") if record is PlanHeader else ()
    for key in obj:
        if key not in fields and key not in envelope:
            fail(_path(where, key), f"is unknown: not a field of {where or 'the header'}")
    for key, f in fields.items():
        if key not in obj and not f.metadata.get("optional"):
            fail(_path(where, key), "is missing")


class _Tables:
    """The header's tensor tables, each checked (types, ranges, rules between tables) as it is read."""

    def __init__(self, obj: dict, dst_ranks: int, box_classes: int, fail):
        self.obj, self.dst_ranks, self.box_classes, self.fail = obj, dst_ranks, box_classes, fail

    def list(self, key: str) -> list:
        value = self.obj.get(key, [])
        if not isinstance(value, list):
            self.fail(key, "is not a list")
        return value

    def sources(self, trainer: TrainerHeader) -> tuple[TensorEntry, ...]:
        entries = []
        for i, entry in enumerate(self.list("sources")):
            where = f"sources[{i}]"
            if not isinstance(entry, list) or len(entry) != 4 or not isinstance(entry[0], str) or not _dtype(entry[2]) \
                    or not _count(entry[3], self.box_classes):
                self.fail(where, "is not [name, shape, dtype, layout class]")
            _shape(entry[1], where, self.fail)
            if any(b is not None and (len(b) != len(entry[1]) or any(hi > size for (_, hi), size in zip(b, entry[1])))
                   for b in trainer.boxes[entry[3]]):
                self.fail(where, f"has shape {entry[1]}, which a box of its layout class {entry[3]} does not fit")
            entries.append(TensorEntry.from_source_row(entry))
        return tuple(entries)

    def dest_row(self, entry, where: str) -> TensorEntry:
        """A [name, shape, dtype, inference ranks] row."""
        if not isinstance(entry, list) or len(entry) != 4 or not isinstance(entry[0], str) or not _dtype(entry[2]):
            self.fail(where, "is not [name, shape, dtype, inference ranks]")
        _shape(entry[1], where, self.fail)
        _ranks(entry[3], self.dst_ranks, where, self.fail)
        return TensorEntry.from_dest_row(entry)

    def dests(self) -> tuple[TensorEntry, ...]:
        held, entries = set(), []
        for i, row in enumerate(self.list("dests")):
            entry = self.dest_row(row, f"dests[{i}]")
            pairs = {(entry.name, rank) for rank in entry.ranks}
            if pairs & held:  # one name has one entry per rank (entries of other ranks may share the name)
                self.fail(f"dests[{i}]", f"gives destination {entry.name!r} a second entry on inference rank {min(pairs & held)[1]}")
            held |= pairs
            entries.append(entry)
        return tuple(entries)

    def unloaded(self, rows, dests: tuple[TensorEntry, ...]) -> tuple[TensorEntry, ...]:
        """Parameters vLLM's load never writes: never a destination on the same rank."""
        if not isinstance(rows, list):
            self.fail("inference.unloaded", "is not a list")
        held = {(e.name, rank) for e in dests for rank in e.ranks}
        entries = []
        for i, row in enumerate(rows):
            entry = self.dest_row(row, f"inference.unloaded[{i}]")
            if any((entry.name, rank) in held for rank in entry.ranks):
                self.fail(f"inference.unloaded[{i}]",
                          f"lists {entry.name!r}, a destination of the plan on the same inference rank, as never written")
            entries.append(entry)
        return tuple(entries)

    def cast_chains(self) -> tuple[tuple[str, ...], ...]:
        chains = self.list("cast_chains")
        for i, chain in enumerate(chains):
            if not isinstance(chain, list) or not is_chain(chain, DTYPE_SIZES):
                self.fail(f"cast_chains[{i}]", f"is not {CHAIN_RULE}")
        return tuple(tuple(c) for c in chains)

    def staging(self, dests: tuple[TensorEntry, ...], layout: QuantLayout | None) -> tuple[StagingEntry, ...]:
        rows = self.list("staging")
        if rows and layout is None:
            self.fail("quant_layout", "is empty, but the plan quantizes tensors (staging)")
        for i, entry in enumerate(rows):
            where = f"staging[{i}]"
            if not isinstance(entry, list) or len(entry) != 6 or not isinstance(entry[0], str) or entry[2] != "bfloat16":
                self.fail(where, "is not [name, shape, bfloat16, inference ranks, weight entry, scale entry]")
            if not _count(entry[4], len(dests)) or not _count(entry[5], len(dests)):
                self.fail(where, f"names a destination outside the table ({str(entry[4:])[:40]} of {len(dests)} entries)")
            _shape(entry[1], where, self.fail)
            _ranks(entry[3], self.dst_ranks, where, self.fail)
            _quantized(StagingEntry.from_row(entry), dests, layout.block, where, self.fail)
        used = [e[k] for e in rows for k in (4, 5)]
        if len(set(used)) != len(used):
            self.fail("staging", "names one destination entry as the weight or scale of two quantized tensors")
        return tuple(StagingEntry.from_row(row) for row in rows)

    def constants(self) -> tuple[ConstantRun, ...]:
        """Rows of four; their types and ranges are invariants.check_constants'."""
        rows = self.list("constants")
        if "constants" in self.obj and not rows:
            self.fail("constants", "is empty: a plan without constant writes has no constants table")
        for i, entry in enumerate(rows):
            if not isinstance(entry, list) or len(entry) != 4:
                self.fail(f"constants[{i}]", "is not [dest, dst_off, length, value]")
        return tuple(ConstantRun(*row) for row in rows)

    def derived(self) -> tuple[DerivedItem, ...]:
        rows = self.list("derived")
        for i, entry in enumerate(rows):
            if not (isinstance(entry, list) and len(entry) == 4 and all(isinstance(entry[k], str) for k in (0, 1, 3))
                    and isinstance(entry[2], list) and all(isinstance(name, str) for name in entry[2])):
                self.fail(f"derived[{i}]", "is not [module, what, parameters read, where]")
        return tuple(DerivedItem.from_row(row) for row in rows)

    def fanout(self, n_dests: int) -> Fanout | None:
        """{"gpus_per_node": G, "first_hops": [[dest, [ranks...]], ...]}: types and ranges (the rules are invariants.py's)."""
        if "fanout" not in self.obj:
            return None
        fanout = self.obj["fanout"]
        _check_keys(fanout, Fanout, "fanout", self.fail)
        _int(fanout, "gpus_per_node", 1, MAX_RANKS, "fanout", self.fail)
        hops = fanout["first_hops"]
        if not isinstance(hops, list):
            self.fail("fanout.first_hops", "is not a list")
        for i, row in enumerate(hops):
            where = f"fanout.first_hops[{i}]"
            if not isinstance(row, list) or len(row) != 2 or not _count(row[0], n_dests):
                self.fail(where, f"is not [dest entry, pulling ranks] with an entry of the {n_dests} destinations")
            _ranks(row[1], self.dst_ranks, where, self.fail)
        return Fanout.from_row(fanout)


def _path(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _str(obj: dict, key: str, where: str, fail) -> str:
    value = obj[key]
    if not isinstance(value, str):
        fail(_path(where, key), f"is {str(value)[:40]}, not a string")
    return value


def _int(obj: dict, key: str, low: int, high: int, where: str, fail) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        fail(_path(where, key), f"is {str(value)[:40]}, not an integer in {low}..{high}")
    return value


def _box(ranges: list) -> Box:
    return tuple((start, stop) for start, stop in ranges)


def _dtype(value) -> bool:
    return isinstance(value, str) and value in DTYPE_SIZES


def _count(value, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < limit


def _quantized(entry: StagingEntry, dests: tuple[TensorEntry, ...], block: tuple[int, int], where: str, fail) -> None:
    """A staging tensor's weight entry is fp8 of its shape and its scale entry float32 per block, on the same ranks."""
    shape = entry.shape
    if len(shape) < 2:
        fail(where, f"has shape {list(shape)}: a quantized tensor has at least 2 dimensions")
    grid = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    for index, dtype, expected in ((entry.weight, "float8_e4m3fn", shape), (entry.scale, "float32", grid)):
        dest = dests[index]
        if dest.dtype != dtype or dest.shape != expected or dest.ranks != entry.ranks:
            fail(where, f"names entry {index} ({dest.name!r} {dest.dtype}{list(dest.shape)} on ranks {list(dest.ranks)}); "
                        f"{entry.name!r} needs {dtype}{list(expected)} on ranks {list(entry.ranks)}")


def _shape(shape, where: str, fail) -> None:
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_count(d, MAX_ELEMENTS) for d in shape) \
            or math.prod(shape) >= MAX_ELEMENTS:
        fail(where, f"has shape {str(shape)[:60]}, not at most {MAX_DIMS} non-negative sizes of fewer than 2**48 elements")


def _ranks(ranks, dst_ranks: int, where: str, fail) -> None:
    if not isinstance(ranks, list) or not ranks or not all(_count(r, dst_ranks) for r in ranks) or ranks != sorted(set(ranks)):
        fail(where, f"lists inference ranks {str(ranks)[:40]}, not increasing ranks of the plan's {dst_ranks}")
