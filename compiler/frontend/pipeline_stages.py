"""Which hidden layers each vLLM pipeline rank holds: vLLM's own `get_pp_indices`, checked before anything is traced."""

from __future__ import annotations

from weightplan.runtime.errors import one_line
from .errors import ModelConfigError


def hidden_layers(config: dict) -> int:
    """The decoder layer count vLLM splits into pipeline stages (`num_hidden_layers`; MTP layers are not split)."""
    text = config.get("text_config") or {}
    layers = config.get("num_hidden_layers", text.get("num_hidden_layers"))
    if not isinstance(layers, int) or layers < 1:
        raise ModelConfigError("pipeline parallel layouts need num_hidden_layers (a positive integer) in config.json")
    return layers


def stage_layers(layers: int, pp: int) -> list[range]:
    """The layer range of every pipeline rank, as vLLM's `make_layers` gets it (honours VLLM_PP_LAYER_PARTITION)."""
    from vllm.distributed.utils import get_pp_indices

    try:
        return [range(*get_pp_indices(layers, rank, pp)) for rank in range(pp)]
    except ValueError as exc:  # a VLLM_PP_LAYER_PARTITION that is not integers, or does not fit pp / the layer count
        raise ModelConfigError(f"VLLM_PP_LAYER_PARTITION: {one_line(exc)}") from None


def check_pipeline_stages(config: dict, pp: int) -> list[range]:
    """Refuse a `pp` that would leave a pipeline rank without layers; return every rank's layers."""
    layers = hidden_layers(config)
    if pp > layers:
        raise ModelConfigError(f"inference pp={pp} is more than the model's {layers} hidden layers: a pipeline rank would hold none")
    stages = stage_layers(layers, pp)
    empty = [rank for rank, held in enumerate(stages) if not held]
    if empty:
        raise ModelConfigError(f"inference pp={pp}: pipeline rank {empty[0]} holds no layers (VLLM_PP_LAYER_PARTITION gives it 0)")
    return stages
