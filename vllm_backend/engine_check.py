"""Which plan rank a worker is, and whether a plan fits the live engine: checked before any memory is registered."""

from __future__ import annotations

import torch

from weightplan.runtime import Plan, PlanMismatchError
from weightplan.runtime.lora_slots import stacked_slices
from weightplan.runtime.plan.header import DraftHeader, RankCoords

from .live_patches import method_name


def plan_rank(parallel_config, tp_rank: int, pp_rank: int, offset: int) -> int:
    """This worker's inference rank in the plan: `offset` plus its global worker index as vLLM numbers workers (dp, then
    pp, then tp: RankCoords), from its ranks in vLLM's TP and PP groups and the engine's data parallel index."""
    at = RankCoords(tp_rank, pp_rank, parallel_config.data_parallel_index)
    return offset + at.rank(parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size)


def owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str] | None:
    """(module, attribute) holding parameter `name` in the live model, or None."""
    module_name, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_name) if module_name else model
    except AttributeError:
        return None
    return (module, attr) if attr in module._parameters else None


def loader_shape(module: torch.nn.Module, attr: str, live: torch.Tensor) -> tuple[int, ...] | None:
    """The shape vLLM's loader gives this parameter, read from the module when its post-load step reshaped it.

    Unquantized linears keep their partition sizes (`output_size_per_partition`,
    `input_size_per_partition`) after CPU packing emptied `weight`; fused MoE layers keep
    (experts, hidden, intermediate per partition) while CPU repacking pads the intermediate dim.
    None when the module does not say (then only names and dtypes are checked).
    """
    if hasattr(module, "output_size_per_partition") and hasattr(module, "input_size_per_partition"):
        out, inp = module.output_size_per_partition, module.input_size_per_partition
        return {"weight": (out, inp), "bias": (out,)}.get(attr)
    if method_name(module) == "UnquantizedFusedMoEMethod":
        e, h, i = module.local_num_experts, module.hidden_size, module.intermediate_size_per_partition
        return {"w13_weight": (e, 2 * i, h), "w2_weight": (e, h, i)}.get(attr)
    return tuple(live.shape) if live.numel() else None


def check_engine(plan: Plan, rank: int, model: torch.nn.Module, vllm_config, platform: str, *, model_config=None,
                 target: torch.nn.Module | None = None) -> list[str]:
    """Raise PlanMismatchError naming what differs between the plan and this live engine; return the held names.

    For the speculative draft, `model_config` is its config and `target` the target model: a draft
    plan must be one (`compile-plan --draft`), and the parameters it leaves to the target's plan
    (`inference.draft.shared_with_target`) must be the target's in the live draft.
    """
    header = plan.header
    model_config = model_config or vllm_config.model_config
    problems = _layout_problems(plan, rank, vllm_config, platform, model_config)
    problems += _kernel_problems(plan, model, platform)
    problems += _draft_problems(header.inference.draft, model, target)
    held = [e for e in plan.dests if rank in e.ranks]
    missing, wrong = [], []
    for entry in held:
        found = owner(model, entry.name)
        if found is None:
            missing.append(entry.name)
            continue
        module, attr = found
        live = module._parameters[attr]
        shape = loader_shape(module, attr, live)
        dtype = str(live.dtype).removeprefix("torch.")
        if dtype != entry.dtype or (shape is not None and tuple(shape) != tuple(entry.shape)):
            wrong.append(f"{entry.name}: plan {entry.dtype}{list(entry.shape)}, engine {dtype}{list(shape or live.shape)}")
    if missing:
        problems.append(f"{len(missing)} planned parameters are not in the engine's model, e.g. {', '.join(missing[:3])}")
    if wrong:
        problems.append(f"{len(wrong)} parameters differ, e.g. {'; '.join(wrong[:3])}")
    _refuse(problems, f"plan {header.model!r} ({header.fingerprint[:12]}) does not match this engine "
                      f"({model_config.model}{' draft' if target is not None else ''}, inference rank {rank})")
    return [e.name for e in held]


def _refuse(problems: list[str], what: str) -> None:
    if problems:
        raise PlanMismatchError(f"{what}: " + "; ".join(problems))


def engine_capability() -> str:
    """This engine's GPU compute capability as a cuda plan's header records it ("9.0"), read from vLLM's platform."""
    from vllm.platforms import current_platform

    capability = current_platform.get_device_capability()
    return f"{capability.major}.{capability.minor}" if capability is not None else "unknown"


def _eplb_problems(eplb, par) -> list[str]:
    """An engine with vLLM's expert load balancer needs a plan compiled for it with its redundant experts (the receiver
    maps expert slots through the engine's current table, runtime/tables/eplb.py), and a plan for EPLB such an engine.
    vLLM's CUDA, ROCm and XPU platforms run EPLB; the CPU platform refuses it."""
    enabled = bool(getattr(par, "enable_eplb", False))
    redundant = getattr(getattr(par, "eplb_config", None), "num_redundant_experts", 0) if enabled else None
    if enabled and eplb is None:
        return [f"enable_eplb ({redundant} redundant experts): vLLM's expert load balancer moves experts between physical "
                f"slots while serving, and this plan was compiled without it; compile it with --inference ...,ep,"
                f"eplb={redundant} (docs/vllm.md#expert-load-balancing-eplb)"]
    if not enabled and eplb is not None:
        return [f"the plan is for an engine with --enable-eplb and {eplb.redundant_experts} redundant experts; this "
                "engine runs without EPLB"]
    if enabled and redundant != eplb.redundant_experts:
        return [f"redundant experts: plan {eplb.redundant_experts}, engine {redundant} (eplb_config.num_redundant_experts)"]
    return []


def _layout_problems(plan: Plan, rank: int, vllm_config, platform: str, model_config,
                     capability: str | None = None) -> list[str]:
    """What differs between the plan's inference layout and this engine: architecture, tp, rank, platform, the GPU's
    compute capability (cuda plans; `capability` None reads the engine's), vLLM."""
    header, problems = plan.header, []
    arch = list(getattr(model_config.hf_config, "architectures", None) or [])
    if header.architecture not in arch:
        problems.append(f"architecture: plan {header.architecture!r}, engine {arch}")
    inference = header.inference
    par = vllm_config.parallel_config
    if inference.tp != par.tensor_parallel_size:
        problems.append(f"tensor parallel size: plan tp={inference.tp}, engine tp={par.tensor_parallel_size}")
    if (inference.pp or 1) != par.pipeline_parallel_size:
        problems.append(f"pipeline parallel size: plan pp={inference.pp or 1}, engine pipeline_parallel_size="
                        f"{par.pipeline_parallel_size}; compile the plan with --inference ...,pp={par.pipeline_parallel_size}")
    problems += _eplb_problems(inference.eplb, par)
    if getattr(par, "prefill_context_parallel_size", 1) > 1:
        problems.append(f"prefill context parallel size {par.prefill_context_parallel_size}: plans describe tp, pp and dp "
                        "only")
    if not 0 <= rank < header.dst_ranks:
        problems.append(f"inference rank: this worker is rank {rank}, the plan has ranks 0..{header.dst_ranks - 1}")
    if inference.platform != platform:
        problems.append(f"platform: plan {inference.platform!r}, engine {platform!r}")
    elif platform == "cuda":  # vLLM picks attention backends, MoE and fp8 kernels (and their layouts) by capability
        device = inference.vllm_host or {}
        engine = capability or engine_capability()
        if device.get("capability") != engine:
            problems.append(f"device capability: plan {device.get('capability')} ({device.get('device')}), engine {engine}")
    import vllm

    if header.vllm_version != vllm.__version__:
        problems.append(f"vLLM version: plan compiled with {header.vllm_version}, engine runs {vllm.__version__}")
    return problems


def _kernel_problems(plan: Plan, model: torch.nn.Module, platform: str) -> list[str]:
    """A cuda plan writes the layout of the MoE backend and fp8 kernels it was traced with: another choice by this
    engine (its --moe-backend, VLLM_USE_DEEP_GEMM, its GPU) keeps the parameters in another layout."""
    if platform != "cuda" or plan.header.inference.platform != "cuda":
        return []
    from weightplan.compiler.frontend.cuda_platform import kernel_choices

    engine = kernel_choices(model)
    planned = {"moe_backend": (plan.header.inference.vllm_host or {}).get("moe_backend", "")}
    if plan.header.quant_layout is not None:
        planned["fp8_linear_kernel"] = plan.header.quant_layout.linear if plan.header.quant_layout.linear != "none" else ""
    hints = {"moe_backend": "start the engine with --moe-backend {setting}",
             "fp8_linear_kernel": "start the engine with VLLM_USE_DEEP_GEMM=0"}
    setting = (plan.header.inference.vllm_host or {}).get("moe_backend_setting", "auto")
    return [f"{key}: plan {planned[key] or 'none'}, engine {engine.get(key, 'none')} ({hints[key].format(setting=setting)}, "
            "as the plan was traced; docs/cuda.md)"
            for key in planned if planned[key] != engine.get(key, "")]


def check_lora_engine(plan: Plan, rank: int, vllm_config, platform: str, manager) -> None:
    """Raise PlanMismatchError naming what keeps a LoRA plan out of this engine's adapter slots.

    `manager`: the engine's LoRA model manager (None without enable_lora). Besides the layout, the adapter's rank
    must fit the engine's max_lora_rank and every planned layer must have the base model's input and output sizes
    (lora_a's last dimension, lora_b's rows): a plan for another base model of the same architecture differs there.
    """
    lora = plan.header.inference.lora
    problems = _layout_problems(plan, rank, vllm_config, platform, vllm_config.model_config)
    config = vllm_config.lora_config
    if manager is None or config is None:
        problems.append("the engine has no LoRA layers: start it with enable_lora=True (--enable-lora)")
    else:
        if lora.rank > config.max_lora_rank:
            problems.append(f"adapter rank {lora.rank} is larger than the engine's max_lora_rank {config.max_lora_rank}")
        if config.max_loras < 2:
            problems.append(f"max_loras {config.max_loras}: LoRA updates alternate between two slots, start the engine "
                            "with max_loras >= 2")
        wrong = []
        for entry in (e for e in plan.dests if rank in e.ranks):
            module_name, kind, index = entry.name.rsplit(".", 2)
            module = manager.modules.get(module_name)
            buffers = stacked_slices(module, kind) if module is not None else ()
            if not index.isdigit() or int(index) >= len(buffers):
                wrong.append(f"{entry.name}: not in the engine")
                continue
            # the base layer's input (A: last axis; an embedding's A is (slots, vocab, max_rank)) or output (B) size
            axis = -1 if kind == "lora_a_stacked" and not _is_embedding(module) else -2
            if buffers[int(index)].shape[axis] != entry.shape[axis]:
                wrong.append(f"{entry.name}: plan {entry.shape[axis]}, engine {buffers[int(index)].shape[axis]}")
        problems += [f"a plan for another base model: {len(wrong)} LoRA layers differ, e.g. {'; '.join(wrong[:3])}"] if wrong else []
    _refuse(problems, f"LoRA plan {plan.header.model!r} ({plan.header.fingerprint[:12]}) does not fit this engine "
                      f"({vllm_config.model_config.model}, inference rank {rank})")


def _is_embedding(module) -> bool:
    from vllm.lora.layers.vocab_parallel_embedding import VocabParallelEmbeddingWithLoRA

    return isinstance(module, VocabParallelEmbeddingWithLoRA)


def _draft_problems(draft: DraftHeader | None, model: torch.nn.Module, target: torch.nn.Module | None) -> list[str]:
    """Why a plan cannot update this model as the target (a draft plan) or as the draft (not one, or unshared tensors)."""
    if target is None:
        return ["this is a draft plan (compile-plan --draft): give it as init_info field 'draft_plan'"] if draft else []
    if not draft:
        return ["this is not a draft plan: compile the draft's with compile-plan --draft"]
    targets = {id(p) for p in target.parameters()}
    own = [name for name in draft.shared_with_target
           if (found := owner(model, name)) is not None and id(found[0]._parameters[found[1]]) not in targets]
    return [f"the live draft's {', '.join(own[:3])} are its own, not the target's; the draft plan leaves them to the "
            "target's plan (vLLM shares them with one pipeline stage)"] if own else []
