"""Layouts of both sides: parse `--trainer` / `--trainer-layout` / `--inference`, and refuse what
vLLM cannot build or what does not fit the trainer's tensors, before anything is traced."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from weightplan.runtime.errors import LayoutError
from weightplan.runtime.layout.shards import MAX_RANKS, ShardLayout, TrainerLayout, layout_items, rank_boxes, shorthands
from weightplan.runtime.layout.layout_file import TrainerLayoutFile, read_trainer_layout
from weightplan.runtime.layout.stages import layer_of
from weightplan.runtime.plan.header import RankCoords
from .frontend.errors import ModelConfigError
from .frontend.pipeline_stages import check_pipeline_stages, hidden_layers
from .frontend.trainer_formats import TrainerFormat
from .trainer_stages import StagedTrainer, parse_staged

__all__ = ["ExplicitTrainer", "InferenceLayout", "TrainerLayout", "parse_trainer", "parse_inference"]


@dataclass(frozen=True)
class InferenceLayout:
    """vLLM serving layout: TP within a pipeline stage, `pp` stages, `dp` replicas, optional expert parallelism (over
    the TP x DP ranks of a stage, as vLLM groups them), the GPUs per node (0: no grouping) that node-local fan-out
    of replicated weights groups ranks by, and vLLM's expert load balancer (`eplb`: its redundant experts; None: off)."""

    tp: int = 1
    dp: int = 1
    ep: bool = False
    gpus_per_node: int = 0
    pp: int = 1
    eplb: int | None = None  # --enable-eplb with this many redundant experts (0: EPLB on, no redundant slot)

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.dp

    def rank_coords(self, rank: int) -> RankCoords:
        """The (tp, pp, dp) ranks of a global inference rank, as vLLM numbers its workers."""
        return RankCoords.of(rank, self.tp, self.pp)

    def rank_of(self, at: RankCoords) -> int:
        return at.rank(self.tp, self.pp)

    @property
    def token(self) -> str:
        return (f"tp{self.tp}" + (f"-pp{self.pp}" if self.pp > 1 else "") + (f"-dp{self.dp}" if self.dp > 1 else "")
                + ("-ep" if self.ep else "") + (f"-eplb{self.eplb}" if self.eplb is not None else "")
                + (f"-node{self.gpus_per_node}" if self.gpus_per_node else ""))

    def check(self, config: dict) -> None:
        """Refuse layouts vLLM cannot build, naming the constraint, before any tracing."""
        heads = config.get("num_attention_heads")
        if heads and heads % self.tp:
            raise ModelConfigError(f"inference tp={self.tp} does not divide num_attention_heads={heads}")
        kv_heads = config.get("num_key_value_heads")
        if kv_heads and kv_heads % self.tp and self.tp % kv_heads:
            raise ModelConfigError(f"inference tp={self.tp} and num_key_value_heads={kv_heads}: neither divides the other")
        experts = routed_experts(config)
        if self.eplb is not None:
            self._check_eplb(experts)
        elif self.ep:
            if not experts:
                raise ModelConfigError("inference ep needs a MoE model; this config has no experts")
            if experts % (self.tp * self.dp):
                raise ModelConfigError(f"inference ep over {self.tp * self.dp} ranks does not divide the {experts} routed experts")
        if self.pp > 1:
            check_pipeline_stages(config, self.pp)

    def _check_eplb(self, experts: int | None) -> None:
        """Refuse an `eplb=R` layout vLLM's EPLB cannot serve or a plan cannot record (header.EplbHeader)."""
        where = f"inference eplb={self.eplb}"
        if not self.ep:
            raise ModelConfigError(f"{where} needs ep: vLLM's expert load balancer moves experts between expert-parallel "
                                   "ranks (--inference ...,ep,eplb=R)")
        if self.pp > 1:
            raise ModelConfigError(f"{where} with pp={self.pp}: EPLB plans cover one pipeline stage; leave out pp")
        if not experts:
            raise ModelConfigError(f"{where} needs a MoE model; this config has no routed experts")
        ranks = self.tp * self.dp
        if ranks < 2:
            raise ModelConfigError(f"{where} needs more than one expert-parallel rank (vLLM's EPLB requires tp or dp > 1)")
        if (experts + self.eplb) % ranks:
            raise ModelConfigError(f"{where}: the {experts} routed experts and {self.eplb} redundant ones make "
                                   f"{experts + self.eplb} physical slots, which the {ranks} expert-parallel ranks do not "
                                   "split evenly")

    def check_platform(self, platform: str) -> None:
        """Refuse in one line a layout the traced vLLM platform (`cpu` or `cuda`) cannot serve: EPLB is cuda-only."""
        if self.eplb is not None and platform != "cuda":
            raise ModelConfigError(f"inference eplb={self.eplb} needs --platform cuda: vLLM's CPU platform refuses "
                                   "enable_eplb (docs/cuda.md, EPLB plans)")


def parse_trainer(text: str, layout_file: Path | None = None,
                  fmt: TrainerFormat = TrainerFormat.HF) -> "TrainerLayout | StagedTrainer | ExplicitTrainer":
    """The trainer layout from `--trainer` or `--trainer-layout FILE` (checked on its own here;
    `.bind(trainer tensors)` then gives the plan's ShardLayout). With `pp=P` it is a StagedTrainer,
    whose stages `check_trainer_stages` resolves against the model config."""
    if layout_file is not None:
        if text != "fsdp=1":
            raise ModelConfigError("pass either --trainer or --trainer-layout, not both")
        return ExplicitTrainer(read_trainer_layout(layout_file), fmt)
    keys = [p.strip().partition("=") for p in str(text).split(",")]
    staged = {k: v for k, _, v in keys if k in ("pp", "pp-layers")}
    if len(staged) < sum(k in ("pp", "pp-layers") for k, _, _ in keys):
        raise ModelConfigError(f"--trainer {text!r} gives pp or pp-layers twice")
    if staged:
        if "pp" not in staged:
            raise ModelConfigError("--trainer pp-layers needs pp=P")
        rest = ",".join(p for p in text.split(",") if p.strip().partition("=")[0] not in staged)
        layout = parse_staged(staged, rest)
    else:
        try:
            layout = TrainerLayout.parse(text)
        except ValueError as exc:
            raise ModelConfigError(str(exc)) from None
    if layout.ep > 1 and fmt.checkpoint_names:
        raise ModelConfigError("trainer ep needs --trainer-format transformers (alias stacked: experts stacked on dim 0) "
                               "or a --trainer-adapter")
    return layout


def routed_experts(config: dict) -> int | None:
    """The model's routed expert count, under the names HF configs use for it (None for a dense model)."""
    return config.get("n_routed_experts") or config.get("num_experts") or config.get("num_local_experts")


def check_trainer_stages(layout, config: dict):
    """The layout with a pipeline-parallel trainer's stages resolved for this config (others unchanged)."""
    return layout.resolve(config) if isinstance(layout, (StagedTrainer, ExplicitTrainer)) else layout


def check_trainer_experts(layout, config: dict) -> None:
    """Refuse a `--trainer ep=M` with more expert-parallel ranks than the model has routed experts."""
    ep = getattr(layout, "ep", 1)
    if ep == 1:
        return
    experts = routed_experts(config)
    if not experts:
        raise ModelConfigError(f"--trainer ep={ep} needs a MoE model; this config has no routed experts")
    if ep > experts:
        raise ModelConfigError(f"--trainer ep={ep} is more than the model's {experts} routed experts: some EP ranks would hold none")


@dataclass(frozen=True)
class ExplicitTrainer:
    """A `--trainer-layout` file for trainer tensors of format `fmt`; `layer_count` (from `resolve(config)`) lets a
    pipelined file's plan take the `--trainer pp=` token when it holds the same boxes."""

    file: TrainerLayoutFile
    fmt: TrainerFormat
    layer_count: int | None = None  # the model's num_hidden_layers

    @property
    def pp(self) -> int:
        return self.file.pp or 1

    def resolve(self, config: dict) -> "ExplicitTrainer":
        return dataclasses.replace(self, layer_count=hidden_layers(config)) if self.pp > 1 else self

    def bind(self, specs) -> ShardLayout:
        """Check the file against the trainer's tensors (names, global shapes, dtypes); LayoutError names the tensor."""
        where = f"trainer layout {self.file.path}"
        tensors = self.file.tensors
        known = {s.name for s in specs}
        unknown = [name for name in tensors if name not in known]
        if unknown:
            raise LayoutError(f"{where}: tensor {unknown[0]!r} is not a trainer tensor of --trainer-format {self.fmt}; "
                              "write the file from the trainer model, or pass the --trainer-format its names follow")
        missing = [s.name for s in specs if s.name not in tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise LayoutError(f"{where} has no entry for trainer tensor {missing[0]!r}{more}; every trainer tensor "
                              f"of --trainer-format {self.fmt} needs one")
        for spec in specs:
            entry = tensors[spec.name]
            if entry.shape != tuple(spec.shape):
                raise LayoutError(f"{where}: tensor {spec.name!r} has global shape {list(entry.shape)}, the trainer "
                                  f"tensor is {list(spec.shape)}; write the file from the same model config")
            if entry.dtype != spec.dtype:
                raise LayoutError(f"{where}: tensor {spec.name!r} is {entry.dtype}, the trainer tensor is {spec.dtype} "
                                  "(masters follow --trainer-dtype); pass the matching --trainer-dtype")
        layout = ShardLayout.build(specs, [tensors[s.name].sharding for s in specs])
        return dataclasses.replace(layout, token=self._staged_token(specs, layout)) if self.pp > 1 else layout

    def _staged_token(self, specs, layout: ShardLayout) -> str:
        """The token of the `--trainer pp=P,...` shorthand with this file's boxes (its default split first), else the
        layout's own; each stage's inner shorthand is tried with the smallest ep first, as for unpipelined layouts."""
        if self.layer_count is None:
            return layout.token
        per_stage = self.file.world_size // self.pp
        held: list[set[int]] = [set() for _ in range(self.pp)]
        for name, entry in self.file.tensors.items():
            layer = layer_of(name)
            if layer is not None and layer < self.layer_count:
                held[entry.sharding.mesh.ranks[0] // per_stage].add(layer)
        config, names, world = {"num_hidden_layers": self.layer_count}, frozenset(s.name for s in specs), layout.ranks
        for explicit in (None, tuple(map(len, held))):
            for inner in shorthands(per_stage):
                try:
                    staged = StagedTrainer(self.pp, inner, explicit).resolve(config)
                    if all(rank_boxes(staged.sharding_of(s, names), tuple(s.shape), world) == layout.classes[layout.of[i]]
                           for i, s in enumerate(specs)):
                        return staged.token
                except (ModelConfigError, ValueError):
                    continue
        return layout.token


INFERENCE_FORM = "tp=T[,pp=P][,dp=D][,ep][,eplb=R][,gpus-per-node=G]"
MAX_REDUNDANT_EXPERTS = 1 << 16


def parse_inference(text: str) -> InferenceLayout:
    """Parse `tp=T[,pp=P][,dp=D][,ep][,eplb=R][,gpus-per-node=G]` (eplb=R: vLLM's EPLB with R redundant experts, R >= 0)."""
    eplb, rest = _eplb_item(text)
    try:
        items = layout_items(rest, "--inference", INFERENCE_FORM, ("tp", "pp", "dp", "gpus-per-node"), ("ep",)) \
            if rest or eplb is None else {}
    except ValueError as exc:
        raise ModelConfigError(str(exc).replace(repr(rest), repr(text))) from None
    layout = InferenceLayout(**{k.replace("-", "_"): v for k, v in items.items()}, eplb=eplb)
    if layout.gpus_per_node == 1:
        raise ModelConfigError("--inference gpus-per-node=1 leaves no peer on a node to fan out to; give the GPUs per "
                               "node (e.g. 8) or leave it out")
    if layout.ranks > MAX_RANKS:
        raise ModelConfigError(f"--inference {text!r} has {layout.ranks} ranks; plans support at most {MAX_RANKS} per side")
    return layout


def _eplb_item(text: str) -> tuple[int | None, str]:
    """(R of an `eplb=R` item or None, the other items): R is 0 or more, given once."""
    if not isinstance(text, str):
        return None, text
    parts = [p.strip() for p in text.split(",")]
    found = [p for p in parts if p.partition("=")[0] == "eplb"]
    if not found:
        return None, text
    if len(found) > 1:
        raise ModelConfigError(f"--inference {text!r} gives eplb twice")
    value = found[0].partition("=")[2]
    if not (value.isascii() and value.isdigit()) or int(value) > MAX_REDUNDANT_EXPERTS:
        raise ModelConfigError(f"bad --inference item {found[0]!r} in {text!r}: expected eplb=R with R redundant experts, "
                               f"0..{MAX_REDUNDANT_EXPERTS}")
    return int(value), ",".join(p for p in parts if p != found[0])
