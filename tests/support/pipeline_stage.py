"""A pipeline stage of a transformers causal LM as torchtitan's split leaves it: only its layers, global indices kept."""

from __future__ import annotations

import torch


def stage_module(full, stage: int, layers: range, last: bool) -> torch.nn.Module:
    """Stage `stage` of `full` holding `layers` (a ModuleDict keyed by global index), the embedding on the first stage,
    the final norm and LM head on the last (`last`)."""
    root, inner = torch.nn.Module(), torch.nn.Module()
    root.model = inner
    inner.layers = torch.nn.ModuleDict({str(i): full.model.layers[i] for i in layers})
    if stage == 0:
        inner.embed_tokens = full.model.embed_tokens
    if last:
        inner.norm, root.lm_head = full.model.norm, full.lm_head
    return root
