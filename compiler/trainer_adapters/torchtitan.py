"""torchtitan's DeepSeek-V3 model as a trainer: its state dict on meta and its own StateDictAdapter.to_hf."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class TorchtitanDeepSeekV3:
    """`--trainer-adapter weightplan.compiler.trainer_adapters.torchtitan:TorchtitanDeepSeekV3` for a DeepSeek-V3 config.

    The trainer tensors are torchtitan's own (`layers.N.moe.routed_experts.inner_experts.w1_EFD`
    with every expert stacked on dim 0, ...), built from the Hugging Face config's sizes; the
    mapping to checkpoint names is torchtitan's `DeepSeekV3StateDictAdapter.to_hf`, unchanged.
    """

    def __init__(self, config_dir: Path, dtype: torch.dtype):
        from torchtitan.models.common.rope import ComplexRoPE
        from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3StateDictAdapter, build_mla_moe_layers
        from torchtitan.models.deepseek_v3 import _depth_experts_init, _depth_init, _LINEAR_INIT, _NORM_INIT
        from torchtitan.models.common import Embedding, Linear, RMSNorm

        c = json.loads((Path(config_dir) / "config.json").read_text())
        if c.get("model_type") != "deepseek_v3":
            raise ValueError(f"torchtitan's DeepSeek-V3 adapter needs a deepseek_v3 config, not {c.get('model_type')!r}")
        dim, vocab = c["hidden_size"], c["vocab_size"]
        layers = build_mla_moe_layers(
            n_layers=c["num_hidden_layers"], n_dense_layers=c.get("first_k_dense_replace", 0), dim=dim,
            n_heads=c["num_attention_heads"], q_lora_rank=c.get("q_lora_rank") or 0, kv_lora_rank=c["kv_lora_rank"],
            qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
            mscale=1.0, dense_hidden_dim=c["intermediate_size"], moe_hidden_dim=c["moe_intermediate_size"],
            num_experts=c["n_routed_experts"], num_shared_experts=c.get("n_shared_experts") or 0,
            router_top_k=c["num_experts_per_tok"], router_score_func=c.get("scoring_func", "softmax"),
            router_num_expert_groups=c.get("n_group"), router_num_limited_groups=c.get("topk_group"),
            attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
            linear_init=_LINEAR_INIT, norm_init=_NORM_INIT, depth_init=_depth_init, depth_experts_init=_depth_experts_init,
            rope=ComplexRoPE.Config(dim=c["qk_rope_head_dim"], max_seq_len=c.get("max_position_embeddings", 4096),
                                    theta=float(c.get("rope_theta", 10000.0))),
        )
        config = DeepSeekV3Model.Config(
            vocab_size=vocab, dim=dim,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_NORM_INIT),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
            layers=layers,
        )
        with torch.device("meta"):
            model = config.build()
        self._tensors = dict(model.state_dict())  # load_adapter casts to the trainer dtype
        self._adapter = DeepSeekV3StateDictAdapter(config, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._tensors)

    def is_expert(self, name: str) -> bool:
        """Routed experts are stacked on dim 0 (what expert parallelism shards)."""
        return ".routed_experts." in name

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._adapter.to_hf(state_dict)
