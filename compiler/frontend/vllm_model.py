"""Build a vLLM model on the meta device, with a real VllmConfig, for one inference rank."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from weightplan.runtime.errors import one_line
from .cuda_platform import note_kernel_choices
from .errors import ModelConfigError
from .vllm_patches import (clear_layer_registry, forget_pp_missing_layers, host_independent, model_build, parallel_rank,
                           refuse_mla_without_backend, share_with_target)

# vLLM's MTP speculative decoding, as `--speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'` asks.
MTP_SPECULATIVE_CONFIG = {"method": "mtp", "num_speculative_tokens": 1}


def make_vllm_config(config_dir: Path, *, tp: int = 1, dp: int = 1, ep: bool = False, quantization: str | None = None,
                     draft: bool = False, pp: int = 1, moe_backend: str | None = None, eplb: int | None = None):
    """A VllmConfig exactly as `vllm serve` would derive it from this config (no tokenizer, no weights).

    With `draft`, MTP speculative decoding is on: `speculative_config.draft_model_config` is the
    draft model vLLM builds (`SpeculativeConfig.hf_config_override` picks its class), and
    `build_model` builds that draft. With `eplb` (R redundant experts), vLLM's expert load balancer is
    on, as `--enable-eplb --eplb-config '{"num_redundant_experts": R}'` asks (vLLM's CUDA platform only).
    """
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(config_dir),
        skip_tokenizer_init=True,
        load_format="dummy",
        enforce_eager=True,
        max_model_len=128,
        quantization=quantization,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        data_parallel_size=dp,
        enable_expert_parallel=ep,
        speculative_config=dict(MTP_SPECULATIVE_CONFIG) if draft else None,
        **({"moe_backend": moe_backend} if moe_backend is not None else {}),  # a cuda plan's --moe-backend
        **({"enable_eplb": True, "eplb_config": {"num_redundant_experts": eplb}} if eplb is not None else {}),
    )
    try:
        with host_independent():  # the CPU platform adjusts the config from CPU features
            return args.create_engine_config()
    except Exception as exc:  # vLLM raises ValueError/TypeError/pydantic errors here
        raise ModelConfigError(f"vLLM cannot build an engine config from {config_dir / 'config.json'}: {one_line(exc)}") from None


def ensure_single_process_distributed(vllm_config) -> None:
    """vLLM's layers ask the parallel state for ranks; give them a one-process gloo world.

    The model-parallel groups depend on the config (dense models get no EP group), so they are
    rebuilt for every model; the one-process world itself is created once.
    """
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import destroy_model_parallel, model_parallel_is_initialized

    with set_current_vllm_config(vllm_config):
        if model_parallel_is_initialized():
            destroy_model_parallel()
        if not torch.distributed.is_initialized():
            store = Path(tempfile.mkdtemp(prefix="weightplan-dist-")) / "store"
            init_distributed_environment(
                world_size=1, rank=0, distributed_init_method=f"file://{store}", local_rank=0, backend="gloo"
            )
        initialize_model_parallel(1, 1)


def build_model(vllm_config, device: str = "meta", *, tp_rank: int = 0, dp_rank: int = 0, base_config=None,
                pp_rank: int = 0) -> torch.nn.Module:
    """Instantiate the vLLM model class with the config's parameter dtype, as vLLM's loader does.

    `base_config` is a one-rank config of the same model used to set up the process's parallel
    groups; `tp_rank`/`dp_rank`/`pp_rank` select which rank of `vllm_config`'s layout is built (a
    pipeline rank holds vLLM's `PPMissingLayer` for the layers of other stages). A config
    with speculative decoding (`make_vllm_config(draft=True)`) gives the draft model as vLLM's
    proposer builds it (`get_model(vllm_config, model_config=draft_model_config)`), without the
    modules it shares with the target (`vllm_patches.share_with_target`).
    """
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    refuse_mla_without_backend(vllm_config.model_config)
    ensure_single_process_distributed(base_config or vllm_config)
    clear_layer_registry(vllm_config)
    forget_pp_missing_layers()
    model_config = draft_config(vllm_config) or vllm_config.model_config
    try:
        with (
            parallel_rank(vllm_config, tp_rank, dp_rank, pp_rank),
            model_build(),
            set_default_torch_dtype(model_config.dtype),
            torch.device(device),
        ):
            model = initialize_model(vllm_config=vllm_config, model_config=model_config)
            note_kernel_choices(vllm_config, model)
            if model_config is not vllm_config.model_config:
                model.shared_with_target = share_with_target(model)
            return model
    except (ValueError, TypeError, AttributeError, KeyError, AssertionError, NotImplementedError, RuntimeError) as exc:
        raise ModelConfigError(
            f"vLLM cannot build {vllm_config.model_config.architecture} from {vllm_config.model_config.model}: "
            f"{type(exc).__name__}: {one_line(exc)}"
        ) from None


def draft_config(vllm_config):
    """The speculative draft's ModelConfig when the config enables speculative decoding, else None."""
    speculative = vllm_config.speculative_config
    return speculative.draft_model_config if speculative is not None else None


def place_experts(model: torch.nn.Module, vllm_config, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0) -> int | None:
    """Re-point every MoE layer's expert placement to this rank of the layout, as vLLM's elastic EP does.

    Each `RoutedExperts` gets the `FusedMoEParallelConfig` vLLM derives for this rank
    (`FusedMoEParallelConfig.make` under `parallel_rank`) and rebuilds its expert map with
    `update_expert_map()`. Returns the number of layers re-pointed, or None if a layer's number
    of local experts changed: its parameters would then have another shape than on this rank,
    and the model must be dropped.
    """
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    moved = 0
    with parallel_rank(vllm_config, tp_rank, dp_rank, pp_rank):
        for module in experts:
            old = module.moe_config.moe_parallel_config
            # make() flattens the layer's TP size across DP and PCP; undo that to get its input back.
            flat = old.ep_size if old.use_ep else old.tp_size
            new = FusedMoEParallelConfig.make(
                tp_size_=flat // (old.dp_size * old.pcp_size),
                pcp_size_=old.pcp_size,
                dp_size_=old.dp_size,
                sp_size_=old.sp_size,
                vllm_parallel_config=vllm_config.parallel_config,
            )
            if new == old:
                continue
            local = module.local_num_experts
            module.moe_config.moe_parallel_config = new
            if old.use_ep or new.use_ep:
                module.update_expert_map()
            # else every expert is local and only the TP slice moves: the loaders read moe_config's tp_rank,
            # and vLLM keeps no expert map to rebuild (update_expert_map would refuse)
            moved += 1
            if module.local_num_experts != local:
                return None
    return moved


EXPERT_NAME = re.compile(r"^(?P<layer>.+)\.experts\.(?P<expert>\d+)\.")  # a routed expert's checkpoint name
EXPERT_MODULE = re.compile(r"^(?P<layer>.+)\.experts(\..+)?$")


def expert_maps(model: torch.nn.Module) -> dict[str, tuple[int, list[int] | None]]:
    """Each MoE layer's (number of routed experts, vLLM's expert map as a list or None without EP), keyed by layer prefix."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    out = {}
    for name, module in model.named_modules():
        match = EXPERT_MODULE.match(name)
        if match and isinstance(module, RoutedExperts):
            expert_map = getattr(module, "_expert_map", None)
            out[match["layer"]] = (module.global_num_experts, None if expert_map is None else expert_map.tolist())
    return out


def nonlocal_experts(model: torch.nn.Module) -> Callable[[str], bool] | None:
    """A test for checkpoint names `<layer>.experts.<e>.*` of routed experts this rank does not hold (EP), or None.

    vLLM's MoE weight_loader returns without writing for such a name (the expert map sends it to
    -1), so leaving them out of a trace changes no assignment. Names whose layer has no
    `RoutedExperts` module under `<layer>.experts`, or no expert map, are never matched. None under
    EPLB: the expert map then indexes physical slots, not the logical ids checkpoint names carry.
    """
    if eplb_enabled(model):
        return None
    local = {layer: [slot >= 0 for slot in expert_map] for layer, (_, expert_map) in expert_maps(model).items()
             if expert_map is not None}
    if not local:
        return None

    def absent(name: str) -> bool:
        match = EXPERT_NAME.match(name)
        if match is None or match["layer"] not in local:
            return False
        held, expert = local[match["layer"]], int(match["expert"])
        return expert < len(held) and not held[expert]

    return absent


def routed_expert_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's `RoutedExperts` modules with their names, in named_modules order (vLLM's MoE layer order)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return [(name, module) for name, module in model.named_modules() if isinstance(module, RoutedExperts)]


def eplb_enabled(model: torch.nn.Module) -> bool:
    """Whether vLLM built the model's routed experts for its expert load balancer (--enable-eplb)."""
    parallel = (getattr(getattr(module, "moe_config", None), "moe_parallel_config", None)
                for _, module in routed_expert_modules(model))
    return any(getattr(config, "enable_eplb", False) for config in parallel)


# RoutedExperts.get_expert_weights leaves these out: per-tensor activation scales and routing tables, not per slot
NON_SLOT_PARAMETERS = frozenset({"e_score_correction_bias", "w13_input_scale", "w2_input_scale", "hash_indices_table"})


def eplb_layers(model: torch.nn.Module) -> tuple[int, tuple[tuple[str, ...], ...]]:
    """(logical experts, per MoE layer in vLLM's order the names of the parameters whose dim 0 is the local physical
    slot): what `RoutedExperts.get_expert_weights` hands vLLM's expert load balancer, by name."""
    logical, layers = set(), []
    for prefix, module in routed_expert_modules(model):
        logical.add(module.moe_config.num_logical_experts)
        moved = [(name, p) for name, p in module.named_parameters() if name not in NON_SLOT_PARAMETERS and p.dim() >= 1]
        odd = [name for name, p in moved if p.shape[0] != module.local_num_experts]
        if odd:
            raise ModelConfigError(f"{prefix}.{odd[0]}: vLLM's expert load balancer moves it per slot, but its dim 0 is "
                                   f"not the {module.local_num_experts} local slots; an EPLB plan cannot record it")
        layers.append(tuple(f"{prefix}.{name}" for name, _ in moved))
    if len(logical) > 1:
        raise ModelConfigError(f"vLLM built MoE layers with different routed expert counts ({sorted(logical)}); "
                               "EPLB plans need one count")
    return (logical.pop() if logical else 0), tuple(layers)


def check_linear_slots(model: torch.nn.Module, ep_rank: int, ep_size: int) -> None:
    """Refuse in one line a model whose MoE layers do not place physical slots linearly on this rank: rank r holds
    global slots r*L .. r*L+L-1 in order (L = physical experts / ranks), as an EPLB plan's header says."""
    for prefix, module in routed_expert_modules(model):
        physical = module.global_num_experts
        local = physical // ep_size
        expert_map = getattr(module, "_expert_map", None)
        expected = [slot - ep_rank * local if ep_rank * local <= slot < (ep_rank + 1) * local else -1
                    for slot in range(physical)]
        held = None if expert_map is None else expert_map.tolist()
        if physical % ep_size or held != expected:
            raise ModelConfigError(f"{prefix} on expert-parallel rank {ep_rank} of {ep_size}: vLLM's expert map {held} is "
                                   f"not the linear placement of {physical} physical slots an EPLB plan records "
                                   f"({local} per rank, rank r holding r*{local} ..)")
