"""Which plan rank a worker is, and whether a plan fits the live engine: checked before any memory is registered."""

from __future__ import annotations

import torch

from weightplan.runtime import Plan, PlanMismatchError
from weightplan.runtime.plan.header import DraftHeader

from .live_patches import method_name


def plan_rank(parallel_config, tp_rank: int, offset: int) -> int:
    """This worker's inference rank in the plan: vLLM's global worker index (dp index * world size + rank) + offset."""
    return offset + parallel_config.data_parallel_index * parallel_config.world_size + tp_rank


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
    problems = []
    arch = list(getattr(model_config.hf_config, "architectures", None) or [])
    if header.architecture not in arch:
        problems.append(f"architecture: plan {header.architecture!r}, engine {arch}")
    inference = header.inference
    par = vllm_config.parallel_config
    if inference.tp != par.tensor_parallel_size:
        problems.append(f"tensor parallel size: plan tp={inference.tp}, engine tp={par.tensor_parallel_size}")
    if not 0 <= rank < plan.header.dst_ranks:
        problems.append(f"inference rank: this worker is rank {rank}, the plan has ranks 0..{plan.header.dst_ranks - 1}")
    if inference.platform != platform:
        problems.append(f"platform: plan {inference.platform!r}, engine {platform!r}")
    problems += _draft_problems(inference.draft, model, target)
    import vllm

    if header.vllm_version != vllm.__version__:
        problems.append(f"vLLM version: plan compiled with {header.vllm_version}, engine runs {vllm.__version__}")
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
    if problems:
        raise PlanMismatchError(f"plan {header.model!r} ({header.fingerprint[:12]}) does not match this "
                                f"engine ({model_config.model}{' draft' if target is not None else ''}, inference rank {rank}): " + "; ".join(problems))
    return [e.name for e in held]


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
