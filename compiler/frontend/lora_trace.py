"""Trace vLLM's own adapter preparation and `set_lora` into one LoRA slot of a meta model, fed PEFT-named LazyWeights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from weightplan.runtime.lora_slots import stacked_slices
from weightplan.runtime.plan.header import LoraHeader
from ..ir import TensorEntry
from .errors import ModelConfigError, TraceError
from .lazy_weight import LazyWeight, WriteRecorder, dtype_name, tracing
from .trace import TracedLoad
from .vllm_model import build_model
from .vllm_patches import parallel_rank

PEFT_PREFIX = "base_model.model."  # PEFT's name for the wrapped model; vLLM strips it (lora/utils.py)
LORA_ID = 1  # the adapter id of the traced load (any positive id; the plan writes the slot, not the id)
STACKED = ("lora_a_stacked", "lora_b_stacked")  # the *WithLoRA buffers a slot lives in, one tensor per packed slice


@dataclass(frozen=True)
class LoraSpec:
    """What `--lora RANK[,alpha=A][,targets=M+M...][,max_rank=R]` (or a PEFT adapter_config.json) asks for."""

    rank: int
    alpha: float
    targets: tuple[str, ...] | None = None  # PEFT target module names; None: every linear module vLLM supports LoRA on
    max_rank: int | None = None  # the engine's --max-lora-rank; None: the smallest vLLM allows that holds `rank`

    @staticmethod
    def parse(text: str) -> "LoraSpec":
        if text.endswith(".json") or Path(text).is_dir():
            return LoraSpec.from_peft_config(Path(text))
        head, *fields = text.split(",")
        rank = _positive_int(head, "--lora RANK")
        alpha, targets, max_rank = float(rank), None, None
        for item in fields:
            key, _, value = item.partition("=")
            if key == "alpha":
                try:
                    alpha = float(value)
                except ValueError:
                    raise ModelConfigError(f"--lora alpha={value!r} is not a number") from None
            elif key == "targets":
                targets = tuple(t for t in value.split("+") if t)
                if not targets:
                    raise ModelConfigError("--lora targets= is empty; give module names joined by +, e.g. q_proj+v_proj")
            elif key == "max_rank":
                max_rank = _positive_int(value, "--lora max_rank")
            else:
                raise ModelConfigError(f"--lora: unknown field {item!r}; expected RANK[,alpha=A][,targets=M+M...][,max_rank=R]")
        return LoraSpec(rank, alpha, targets, max_rank)

    @staticmethod
    def from_peft_config(path: Path) -> "LoraSpec":
        path = path / "adapter_config.json" if path.is_dir() else path
        try:
            config = json.loads(path.read_text())
            rank, alpha, targets = int(config["r"]), float(config.get("lora_alpha", config["r"])), config.get("target_modules")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelConfigError(f"--lora {path}: not a readable PEFT adapter_config.json ({type(exc).__name__}: {exc})") from None
        if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("use_rslora") or config.get("use_dora"):
            raise ModelConfigError(f"--lora {path}: rank_pattern, alpha_pattern, rslora and DoRA adapters are not supported")
        if isinstance(targets, str):
            raise ModelConfigError(f"--lora {path}: target_modules {targets!r} is a pattern; list the module names")
        return LoraSpec(rank, alpha, tuple(targets) if targets else None)

    def engine_max_rank(self) -> int:
        from vllm.config.lora import MaxLoRARanks
        from typing import get_args

        allowed = get_args(MaxLoRARanks)
        if self.max_rank is not None:
            if self.max_rank not in allowed:
                raise ModelConfigError(f"--lora max_rank={self.max_rank}: vLLM's --max-lora-rank is one of {allowed}")
            if self.rank > self.max_rank:
                raise ModelConfigError(f"--lora rank {self.rank} is larger than the engine's max_lora_rank {self.max_rank}")
            return self.max_rank
        fits = [r for r in allowed if r >= self.rank]
        if not fits:
            raise ModelConfigError(f"--lora rank {self.rank} is larger than vLLM's largest max_lora_rank {max(allowed)}")
        return min(fits)

    def header(self, targets: tuple[str, ...]) -> LoraHeader:
        return LoraHeader(self.rank, self.alpha, self.engine_max_rank(), targets)


def _positive_int(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ModelConfigError(f"{what} {text!r} is not a whole number") from None
    if value < 1:
        raise ModelConfigError(f"{what} {value} must be at least 1")
    return value


def check_lora(opts, fmt, quant) -> LoraSpec:
    """The parsed --lora, refusing options an adapter plan has no meaning for."""
    spec = LoraSpec.parse(opts.lora)
    spec.engine_max_rank()
    if opts.draft or opts.trainer_adapter or fmt.value != "hf" or quant.name != "none":
        raise ModelConfigError("--lora plans take the trainer's PEFT tensors as they are: "
                               "no --draft, --trainer-adapter, --trainer-format or --quant")
    return spec


def enable_lora(vllm_config, spec: LoraSpec, targets: tuple[str, ...] | None, slots: int = 1) -> None:
    """Give `vllm_config` the LoRAConfig of an engine started with enable_lora and `slots` slots (a plan is traced
    with one: the slot it writes)."""
    from vllm.config import LoRAConfig

    config = LoRAConfig(max_lora_rank=spec.engine_max_rank(), max_loras=slots,
                        target_modules=list(targets) if targets is not None else None)
    config.verify_with_model_config(vllm_config.model_config)
    vllm_config.lora_config = config


def lora_model(vllm_config, *, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0, base_config=None, device: str = "meta"):
    """(model, LoRAModelManager): the rank's model with vLLM's own *WithLoRA wrappers, as an engine's LoRA worker builds it
    (on a pipeline rank, vLLM's manager skips the other stages' `PPMissingLayer`s: it wraps only the modules present)."""
    from vllm.config import set_current_vllm_config
    from vllm.lora.model_manager import LoRAModelManager, create_lora_manager

    model = build_model(vllm_config, device, tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank, base_config=base_config)
    scheduler = vllm_config.scheduler_config
    with parallel_rank(vllm_config, tp_rank, dp_rank, pp_rank), set_current_vllm_config(vllm_config), torch.device(device):
        try:
            manager = create_lora_manager(model, max_num_seqs=scheduler.max_num_seqs,
                                          max_num_batched_tokens=scheduler.max_num_batched_tokens,
                                          vocab_size=vllm_config.model_config.get_vocab_size(),
                                          lora_config=vllm_config.lora_config, vllm_config=vllm_config,
                                          device=torch.device(device), lora_manager_cls=LoRAModelManager)
        except ValueError as exc:
            raise ModelConfigError(f"vLLM cannot add LoRA to {vllm_config.model_config.architecture}: {exc}") from None
    return model, manager


def slot_buffers(manager) -> dict[str, torch.Tensor]:
    """`<module>.lora_{a,b}_stacked.<slice>` -> that stacked buffer (one slot: compiled with max_loras=1)."""
    out = {}
    for module_name, module in manager.modules.items():
        for kind in STACKED:
            for i, buffer in enumerate(stacked_slices(module, kind)):
                out[f"{module_name}.{kind}.{i}"] = buffer
    return out


def adapter_sources(manager, spec: LoraSpec, dtype: torch.dtype) -> list[TensorEntry]:
    """The trainer's PEFT tensors (full, unsharded shapes) for every module the one-rank `manager` wraps.

    A packed module (qkv_proj, gate_up_proj) is one PEFT module per slice (q_proj, k_proj, v_proj). An embedding's
    tensors are PEFT's `lora_embedding_A` (rank x vocab) and `lora_embedding_B` (hidden x rank), which vLLM's
    `set_lora` copies transposed / as is; the LM head is a PEFT linear (`lm_head.lora_{A,B}.weight`).
    """
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA
    from vllm.lora.layers.vocab_parallel_embedding import VocabParallelEmbeddingWithLoRA

    out = []
    for module_name, module in manager.modules.items():
        if isinstance(module, VocabParallelEmbeddingWithLoRA):  # lora_a_stacked: (slots, vocab, max_rank)
            a, b = module.lora_a_stacked, module.lora_b_stacked
            out.append(TensorEntry(f"{PEFT_PREFIX}{module_name}.lora_embedding_A", (spec.rank, a.shape[1]), dtype_name(dtype)))
            out.append(TensorEntry(f"{PEFT_PREFIX}{module_name}.lora_embedding_B", (b.shape[-2], spec.rank), dtype_name(dtype)))
            continue
        if not isinstance(module, (BaseLinearLayerWithLoRA, LogitsProcessorWithLoRA)):
            raise ModelConfigError(f"--lora: {module_name} ({type(module).__name__}) is not a linear, embedding or LM head "
                                   "layer; LoRA plans do not cover it")
        subs = manager.packed_modules.get(module_name, [module_name])
        for sub, a, b in zip(subs, stacked_slices(module, "lora_a_stacked"), stacked_slices(module, "lora_b_stacked")):
            out.append(TensorEntry(f"{PEFT_PREFIX}{sub}.lora_A.weight", (spec.rank, a.shape[-1]), dtype_name(dtype)))
            out.append(TensorEntry(f"{PEFT_PREFIX}{sub}.lora_B.weight", (b.shape[-2], spec.rank), dtype_name(dtype)))
    return out


# PEFT module names a default adapter leaves out although vLLM's default (no --lora-target-modules) wraps them.
# Routed MoE experts: vLLM's CPU platform cannot wrap them (its fused-MoE LoRA kernel is Triton); `targets=` refuses
# them. Embeddings and lm_head (wrapped by vLLM when the model class lists `embedding_modules`): a trainer's default
# adapter holds neither (PEFT's "all-linear" leaves out the output layer and every embedding), and an embedding's A is
# copied transposed (vocab x rank one-element descriptors: 512,115 instead of 114 for bench-llama at rank 16), so
# they are planned only when `targets=` names them. Their slot bytes in an engine stay vLLM's zeros: no delta.
EMBEDDINGS = ("embed_tokens", "lm_head")  # the PEFT names vLLM's `embedding_modules` usually lists
REFUSED = ("experts",)
NOT_DEFAULT = REFUSED + EMBEDDINGS


def supported_targets(model) -> tuple[str, ...]:
    """The PEFT module names vLLM supports LoRA on in `model` (a packed module stands for its parts), sorted."""
    from vllm.lora.utils import get_supported_lora_modules, process_packed_modules_mapping

    packed = process_packed_modules_mapping(model)
    return tuple(sorted({part for name in get_supported_lora_modules(model)
                         for part in (packed.get(name, [name]) if name != "experts" else [name])}))


def check_targets(spec: LoraSpec, supported: tuple[str, ...], architecture: str) -> None:
    if spec.targets is None:
        return
    missing = sorted(set(spec.targets) - set(supported))
    if missing:
        why = (f"; vLLM's {architecture} lists no embedding_modules, so it takes no embedding or lm_head LoRA"
               if set(missing) & set(EMBEDDINGS) else "")
        raise ModelConfigError(f"--lora targets {', '.join(missing)}: the model has no such LoRA-capable module "
                               f"(it has {', '.join(supported)}){why}")
    refused = sorted(set(spec.targets) & set(REFUSED))
    if refused:
        raise ModelConfigError(f"--lora targets {', '.join(refused)}: routed MoE experts take LoRA only through vLLM's "
                               "Triton fused-MoE LoRA kernel, which its CPU platform lacks")


def peft_config(spec: LoraSpec, targets: tuple[str, ...]) -> dict:
    """The adapter_config.json PEFT writes for this adapter (what vLLM's PEFTHelper reads)."""
    return {"peft_type": "LORA", "r": spec.rank, "lora_alpha": spec.alpha, "target_modules": list(targets),
            "bias": "none", "task_type": "CAUSAL_LM"}


def trace_adapter(model, manager, sources: list[TensorEntry], spec: LoraSpec, targets: tuple[str, ...]) -> TracedLoad:
    """Run vLLM's LoRAModel.from_lora_tensors, add_adapter (packing, scaling folded into B) and activate_adapter
    (set_lora into slot 0) on LazyWeights named like the trainer's PEFT tensors; the writes into the slot buffers."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    buffers = slot_buffers(manager)
    dests = [TensorEntry(name, tuple(t.shape), dtype_name(t.dtype)) for name, t in buffers.items()]
    tracer = WriteRecorder(buffers)
    helper = PEFTHelper.from_dict({**peft_config(spec, targets), "vllm_max_position_embeddings": None})
    lazy = {s.name: LazyWeight.source(s.name, s.shape, getattr(torch, s.dtype)) for s in sources}
    with tracing(tracer), torch.no_grad():
        tracer.loading = "adapter"
        try:
            adapter = LoRAModel.from_lora_tensors(LORA_ID, lazy, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
                                                  model_vocab_size=manager.vocab_size,
                                                  weights_mapper=_rename_mapper(model),
                                                  skip_prefixes=getattr(model, "lora_skip_prefixes", None))
            manager.add_adapter(adapter)
            manager.activate_adapter(LORA_ID)
        except Exception as exc:
            raise TraceError(f"vLLM's adapter load failed on the traced adapter: {type(exc).__name__}: {exc}") from None
    return TracedLoad(tracer.assignments, dests)


def _rename_mapper(model):
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return mapper.get_rename_mapper() if mapper is not None else None


class LoraRankTracer:
    """RankTracer's interface for an adapter plan: `trace(rank)` builds that rank's LoRA-wrapped meta model and traces
    vLLM's adapter load into its slot."""

    def __init__(self, vllm_config, base_config, layout, spec: LoraSpec, dtype: torch.dtype):
        self.vllm_config, self.base_config, self.layout, self.spec = vllm_config, base_config, layout, spec
        supported = supported_targets(build_model(base_config, base_config=base_config))
        check_targets(spec, supported, base_config.model_config.architecture)
        self.targets = spec.targets or tuple(t for t in supported if t not in NOT_DEFAULT)
        for config in {id(c): c for c in (base_config, vllm_config)}.values():
            enable_lora(config, spec, self.targets)
        model, manager = lora_model(base_config)
        self.sources = adapter_sources(manager, spec, dtype)
        del model, manager
        self.stats = {"models_built": 1}
        self.derived = ()

    def trace(self, rank: int, progress=None) -> TracedLoad:
        at = self.layout.rank_coords(rank)
        model, manager = lora_model(self.vllm_config, tp_rank=at.tp, dp_rank=at.dp, pp_rank=at.pp, base_config=self.base_config)
        self.stats["models_built"] += 1
        with parallel_rank(self.vllm_config, at.tp, at.dp, at.pp):
            return trace_adapter(model, manager, self.sources, self.spec, self.targets)
