"""Tiny configs (transformers' config classes, shrunk) for every causal-LM architecture both vLLM and transformers know."""

from __future__ import annotations

import json
from pathlib import Path

# Values for whichever of these fields a config class has: few layers, tiny dims, vocab a multiple of 64.
TINY = {
    "vocab_size": 256, "hidden_size": 64, "n_embd": 64, "d_model": 64, "intermediate_size": 128, "ffn_hidden_size": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "kv_n_heads": 2, "ffn_hidden_size": 128, "moe_top_k": 2, "num_key_value_heads": 2, "head_dim": 16,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_k": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "index_n_heads": 4, "index_head_dim": 32, "index_topk": 16,
    "max_position_embeddings": 256, "n_positions": 256, "sliding_window": 64,
    "state_size": 16, "mamba_d_state": 16, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1,
    "mamba_expand": 2, "mamba_d_conv": 4, "mamba_d_ssm": 128, "n_groups": 1, "num_heads": 8, "ssm_state_size": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 16, "laurel_rank": 8, "hc_lowrank": 16,
}
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")

# Per model type, values set whether or not the class declares the field (a dict value for a sub-config key,
# e.g. "text_config", is applied inside that sub-config): where vLLM reads a config differently from transformers,
# or where the class's defaults do not build a model, the values published checkpoints use.
_QWEN4_EXP_TEXT = {  # the defaults leave QSA's indexer fields None, which transformers' model cannot build
    "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 64, "indexer_compress_ratio": 4,
}
PER_MODEL = {
    "falcon": {"ffn_hidden_size": 4 * TINY["hidden_size"]},  # vLLM's Falcon MLP is 4 x hidden whatever ffn_hidden_size says
    "dbrx": {"attn_config": {"rope_theta": 500000}},  # both sides read attn_config.rope_theta, which the class omits
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},  # default None: no layer builds
    "gemma3n_text": {  # the last num_kv_shared_layers layers reuse the KV of the last earlier layer of their type
        "num_hidden_layers": 4, "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    },
    "gemma4_text": {"global_head_dim": 32,  # head_dim of the full-attention layers (default 512)
                    "enable_moe_block": True, "top_k_experts": 2},  # vLLM builds MoE blocks whenever num_experts is set
    # Fields vLLM's model reads that transformers' config class does not define (published checkpoints carry them):
    "gptj": {"rotary_dim": 8},  # default 64, wider than the tiny 16-wide heads
    "glm4_moe": {"head_dim": TINY["head_dim"]},
    "glm4_moe_lite": {"first_k_dense_replace": 1},
    "hy_v3": {"first_k_dense_replace": 1, "expert_hidden_dim": TINY["moe_intermediate_size"], "route_norm": True,
              "qk_norm": True},
    "minimax_m2": {"rotary_dim": 8, "scoring_func": "sigmoid", "use_routing_bias": True},
    "afmoe": {"score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1},
    "inkling_text": {"padded_vocab_size": TINY["vocab_size"], "use_embed_norm": False},
    "qwen4_exp_text": _QWEN4_EXP_TEXT,
    "qwen4_exp": {"text_config": _QWEN4_EXP_TEXT},
}


_BASE_ONLY = ("output_attentions", "transformers_version")  # PretrainedConfig fields sub-config classes refuse


def tiny_config(model_type: str, architecture: str, **overrides) -> dict:
    """The config dict of `model_type`'s transformers config class with TINY applied (and `overrides`)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    subs = [k for k in getattr(cls, "sub_configs", {}) or {} if isinstance(defaults.get(k), dict)]
    wanted = {**PER_MODEL.get(model_type, {}), **overrides}
    values = _shrink(defaults, {k: v for k, v in wanted.items() if k not in subs})
    for key in subs:  # nested configs (text_config, Dbrx's ffn_config): shrink them too
        values[key] = _shrink(_clean(defaults[key]), wanted.get(key, {}), whole=True)
    config = cls(**_rederive({**defaults, **values}, defaults)).to_dict()
    for key in getattr(cls, "sub_configs", {}) or {}:
        if isinstance(config.get(key), dict):
            config[key] = _clean(config[key])
    config.update(architectures=[architecture], model_type=model_type, torch_dtype="bfloat16")
    if "n_routed_experts" in config:  # published DeepSeek-style checkpoints; vLLM adds the router bias only then
        config.setdefault("topk_method", "noaux_tc")
    config.pop("transformers_version", None)
    return config


def _shrink(defaults: dict, overrides: dict, whole: bool = False) -> dict:
    """TINY values for the fields `defaults` has, then `overrides`; per-layer lists cut to the new layer count (every kind kept)."""
    layers = next((defaults[k] for k in _LAYER_KEYS if isinstance(defaults.get(k), int)), None)
    values = {**{k: v for k, v in TINY.items() if k in defaults}, **overrides}
    new_layers = next((values[k] for k in _LAYER_KEYS if k in values), layers)
    for key, value in defaults.items():
        if isinstance(value, list) and layers and len(value) == layers and key not in values:
            cut = value[:new_layers]
            missing = [v for v in dict.fromkeys(value) if v not in cut]  # e.g. keep one attention layer in a hybrid
            values[key] = cut[: len(cut) - len(missing)] + missing if missing and len(missing) < len(cut) else cut
        elif key.endswith("_token_id") and isinstance(value, int) and value >= TINY["vocab_size"]:
            values[key] = 1
    return {**defaults, **values} if whole else values


def _rederive(kwargs: dict, defaults: dict) -> dict:
    """Drop per-layer dicts keyed by layer index (Gemma4's per_layer_config) once the layer count changed: the class
    derives them again from the cut per-layer lists."""
    layers = next((kwargs[k] for k in _LAYER_KEYS if isinstance(kwargs.get(k), int)), None)
    return {k: v for k, v in kwargs.items()
            if not (isinstance(v, dict) and v and v is defaults.get(k) and all(str(i).isdigit() for i in v)
                    and any(int(i) >= (layers or 0) for i in v))}


def _clean(config: dict) -> dict:
    return {k: v for k, v in config.items() if not k.startswith("_") and k not in _BASE_ONLY}


def zoo() -> list[tuple[str, str]]:
    """(model_type, architecture) for every transformers causal LM that vLLM's registry serves as a text model: with
    its own model class, or through its Transformers modeling backend (HunYuan-V1, SeedOss, Starcoder2, OLMo, ...)."""
    from vllm.model_executor.models.registry import _MULTIMODAL_MODELS

    return [(mt, arch) for mt, arch in _served() if arch not in _MULTIMODAL_MODELS]


def multimodal_zoo() -> list[tuple[str, str]]:
    """The causal-LM mapping's entries vLLM serves as multimodal models (a vision tower beside the text model):
    not swept, their text models are (gemma3 -> gemma3_text)."""
    from vllm.model_executor.models.registry import _MULTIMODAL_MODELS

    return [(mt, arch) for mt, arch in _served() if arch in _MULTIMODAL_MODELS]


def _served() -> list[tuple[str, str]]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from vllm.model_executor.models.registry import ModelRegistry

    served = set(ModelRegistry.get_supported_archs())
    return sorted((mt, arch) for mt, arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if arch in served)


def write_config(directory: Path, model_type: str, architecture: str, **overrides) -> Path:
    """Write `directory/config.json` for the tiny config; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(tiny_config(model_type, architecture, **overrides), indent=1, sort_keys=True))
    return directory
