"""The speculative-decoding (MTP) draft's trainer tensors: the checkpoint tensors `model.layers.{L+i}.*` vLLM's draft loads."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..ir import TensorEntry
from .errors import ModelConfigError
from .lazy_weight import dtype_name
from .trainer_formats import TrainerFormat

if TYPE_CHECKING:
    from ..quant_compile import QuantMode

DRAFT_METHOD = "mtp"
# vLLM's draft classes whose loading and sharing this module and vllm_patches.share_with_target follow (models/deepseek_mtp.py).
DRAFT_ARCHITECTURES = ("DeepSeekMTPModel", "DeepseekV32MTPModel")


def mtp_layers(config: dict) -> int:
    """The config's MTP layer count (`num_nextn_predict_layers`), 0 when it has none."""
    value = config.get("num_nextn_predict_layers") or 0
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def check_draft(config: dict, config_path, *, fmt: TrainerFormat, quant: QuantMode) -> None:
    """Refuse a draft compile this version cannot do, naming the option, before vLLM is imported."""
    if mtp_layers(config) < 1:
        raise ModelConfigError(f"--draft needs MTP layers, but {config_path} has num_nextn_predict_layers="
                               f"{config.get('num_nextn_predict_layers', 0)!r}")
    if fmt is not TrainerFormat.HF:
        raise ModelConfigError("--draft reads the trainer's MTP tensors under their checkpoint names: use --trainer-format hf "
                               "(the default) and no --trainer-adapter")
    if quant.quantizes:
        raise ModelConfigError(f"--draft compiles bf16 draft plans only; got --quant {quant.name}")


def check_draft_architecture(architecture: str, config_path) -> None:
    """Refuse a draft class other than vLLM's DeepSeek MTP (whose checkpoint names and sharing this compiler follows)."""
    if architecture not in DRAFT_ARCHITECTURES:
        raise ModelConfigError(f"--draft compiles vLLM's DeepSeek MTP drafts ({', '.join(DRAFT_ARCHITECTURES)}: DeepSeek-V3, "
                               f"GLM-5.x); for {config_path} vLLM builds {architecture}")


@dataclass(frozen=True)
class DraftTrainer:
    """The trainer's MTP tensors under their checkpoint names; vLLM's draft load_weights reads them as they are.

    transformers' DeepSeek-V3 / GLM classes have no MTP module, so the main trainer table has no
    MTP tensors. A trainer that trains MTP layers holds them under their checkpoint names (what
    torchtitan's `to_hf` produces for its `mtp_layers`): MTP layer i of a model with L decoder
    layers is `model.layers.{L+i}.*`. Its block is a decoder layer like the model's last one (same
    checkpoint names and shapes; vLLM builds it as `DeepseekV2DecoderLayer`), and the layer's own
    tensors (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`) are read off vLLM's one-rank draft.
    The embedding and LM head the draft uses are the target's in a serving engine
    (vllm_patches.share_with_target): the trainer's `model.embed_tokens.weight` and
    `lm_head.weight` feed the target's plan only.
    """

    checkpoint: tuple[TensorEntry, ...]

    def specs(self, fmt: TrainerFormat) -> list[TensorEntry]:
        return list(self.checkpoint)

    def checkpoint_tensors(self, fmt: TrainerFormat, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        yield from pairs


def draft_trainer(trainer, config: dict, draft: torch.nn.Module, dtype: torch.dtype) -> DraftTrainer:
    """The MTP tensors of a trainer whose main tensors are `trainer` (a TrainerModel), for vLLM's one-rank `draft`."""
    layers, count = config["num_hidden_layers"], mtp_layers(config)
    last = f"model.layers.{layers - 1}."
    block = [entry for entry in trainer.checkpoint.values() if entry.name.startswith(last)]
    if not block:
        raise ModelConfigError(f"the trainer has no checkpoint tensors {last}* to take the MTP block's names from")
    own = [(name, tuple(p.shape)) for name, p in draft.named_parameters()
           if re.match(r"model\.layers\.\d+\.", name) and ".mtp_block." not in name]
    entries: list[TensorEntry] = []
    for index in range(layers, layers + count):
        prefix = f"model.layers.{index}."
        entries += [TensorEntry(name, shape, dtype_name(dtype)) for name, shape in own if name.startswith(prefix)]
        entries += [dataclasses.replace(entry, name=prefix + entry.name[len(last):]) for entry in block]
    return DraftTrainer(tuple(entries))
