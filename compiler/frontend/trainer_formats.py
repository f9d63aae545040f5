"""Trainer tensors and their conversion to checkpoint tensors: transformers' own reverse weight conversion, traced.

`transformers` (alias `stacked`) is the trainer's in-memory layout: the state dict of
transformers' model for the config (e.g. routed experts stacked in `experts.gate_up_proj`).
`hf` is the checkpoint layout vLLM's `load_weights` reads: what `save_pretrained` writes, i.e.
the in-memory tensors passed through transformers' `revert_weight_conversion` (its conversion
mapping, `transformers/conversion_mapping.py`, run backwards). Nothing here names a model,
a tensor or a layout: every rename and split is transformers' own, run on LazyWeights when
tracing and on real tensors in verify-plan.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..ir import TensorEntry
from weightplan.runtime.errors import one_line
from .errors import ModelConfigError
from .lazy_weight import dtype_name

class TrainerFormat(enum.StrEnum):
    """The names trainer tensors go by, as the plan header records them (the --trainer-format value, or `adapter`)."""

    HF = "hf"
    TRANSFORMERS = "transformers"
    STACKED = "stacked"  # transformers' in-memory names under the name plans and docs used before its mapping was traced
    ADAPTER = "adapter"  # a --trainer-adapter's own names (frontend/trainer_adapter.py)

    @classmethod
    def parse(cls, text: str) -> "TrainerFormat":
        """A --trainer-format value (`adapter` comes with --trainer-adapter only)."""
        options = [fmt.value for fmt in cls if fmt is not cls.ADAPTER]
        if text not in options:
            raise ModelConfigError(f"unknown --trainer-format {text!r}; choose one of {', '.join(options)}")
        return cls(text)

    @property
    def checkpoint_names(self) -> bool:
        """True if the trainer's tensors are the checkpoint's (no conversion before vLLM's load_weights)."""
        return self is TrainerFormat.HF


@dataclass(frozen=True, eq=False)
class TrainerModel:
    """transformers' model for one config on meta, and what its reverse weight conversion makes of its tensors."""

    model: torch.nn.Module  # carries its conversion mapping in `_weight_conversions`, computed once
    in_memory: Mapping[str, torch.Tensor]  # the trainer's state dict (tied tensors once), meta
    checkpoint: Mapping[str, TensorEntry]  # checkpoint name -> spec, in feeding order
    group_of: Mapping[str, tuple[str, ...]]  # in-memory name -> the in-memory tensors converted together with it

    def specs(self, fmt: TrainerFormat) -> list[TensorEntry]:
        """The trainer tensors of format `fmt`, in feeding order."""
        if fmt.checkpoint_names:
            return list(self.checkpoint.values())
        plan = getattr(self.model, "ep_plan", {}) or {}
        return [TensorEntry(name, tuple(t.shape), dtype_name(t.dtype), "expert" if _expert_stacked(name, plan) else "dense")
                for name, t in self.in_memory.items()]

    def checkpoint_tensors(self, fmt: TrainerFormat,
                           pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint tensors (name, tensor) vLLM's load_weights consumes for a stream of trainer tensors of `fmt`.

        Works on real, meta and Lazy tensors (Lazy ones inside an active trace). Tensors that
        transformers converts together are buffered until their group is complete; a group still
        incomplete at the end is converted as it is and refused if that changes a checkpoint shape.
        """
        if fmt.checkpoint_names:
            yield from pairs
            return
        pending: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}
        for name, tensor in pairs:
            group = self.group_of.get(name, (name,))
            members = pending.setdefault(group, {})
            members[name] = tensor
            if len(members) == len(group):
                yield from self._convert(pending.pop(group))
        for members in pending.values():
            yield from self._convert(members)

    def _convert(self, tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        converted = _revert(self.model, tensors)
        for name in sorted(converted, key=_natural):
            tensor, spec = converted[name], self.checkpoint.get(name)
            if spec is None or tuple(tensor.shape) != spec.shape:
                raise ModelConfigError(
                    f"transformers' reverse weight conversion of {sorted(tensors)} gives checkpoint tensor {name!r} of "
                    f"shape {tuple(tensor.shape)}, but {spec.shape if spec else 'no such tensor'} from the whole model; "
                    "feed every trainer tensor of a converted group together")
            yield name, tensor


@dataclass(frozen=True)
class Conversion:
    """One trainer format of one model: the trainer -> checkpoint conversion trace_load and verify-plan feed to vLLM."""

    trainer: TrainerModel
    fmt: TrainerFormat

    def __call__(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return self.trainer.checkpoint_tensors(self.fmt, pairs)


def load_trainer_model(config_dir: Path, dtype: torch.dtype) -> TrainerModel:
    """transformers' model for this config on meta (master weights in `dtype`) and its checkpoint tensor table.

    It is transformers' own model, so it is built with every vLLM patch of the compiler lifted.
    """
    from ..models import config_hash
    from .vllm_patches import check_unpatched

    check_unpatched("building the trainer's transformers model")
    return _load_trainer_model(Path(config_dir), dtype, config_hash(Path(config_dir)))


@functools.lru_cache(maxsize=4)  # compile and verify-plan in one process ask for the same model
def _load_trainer_model(config_dir: Path, dtype: torch.dtype, config_sha256: str) -> TrainerModel:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    try:
        config = AutoConfig.from_pretrained(str(config_dir))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as exc:
        raise ModelConfigError(f"transformers cannot build the trainer model from {config_dir}: {one_line(exc)}") from None
    # What revert_weight_conversion derives for a model not loaded by from_pretrained, computed once
    # (it walks every module): the model's mapping without legacy renames and without PrefixChange.
    model._weight_conversions = [t for t in get_model_conversion_mapping(model, add_legacy=False)
                                 if not isinstance(t, PrefixChange)]
    seen: set[int] = set()
    in_memory: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied weights appear under several names; the trainer holds one tensor
            continue
        seen.add(id(tensor))
        in_memory[name] = tensor
    try:
        # Convert each tensor alone to learn which checkpoint names it feeds; tensors feeding a
        # common name (a many-to-one conversion) form a group, converted together.
        alone = {name: _revert(model, {name: t}) for name, t in in_memory.items()}
        names_of = {name: tuple(outs) for name, outs in alone.items()}
        owners: dict[str, list[str]] = {}
        for name, outs in names_of.items():
            for out in outs:
                owners.setdefault(out, []).append(name)
        group_of: dict[str, tuple[str, ...]] = {}
        for name in in_memory:
            group = {name} | {o for out in names_of[name] for o in owners[out]}
            group_of[name] = tuple(n for n in in_memory if n in group)
        checkpoint: dict[str, TensorEntry] = {}
        for name, group in group_of.items():
            if group[0] != name:
                continue
            converted = alone[name] if len(group) == 1 else _revert(model, {n: in_memory[n] for n in group})
            for out in sorted(converted, key=_natural):
                checkpoint[out] = TensorEntry(out, tuple(converted[out].shape), dtype_name(converted[out].dtype))
    except Exception as exc:
        raise ModelConfigError(f"transformers' reverse weight conversion fails for {config_dir}: {exc}") from None
    return TrainerModel(model, in_memory, checkpoint, group_of)


def _revert(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, dict(tensors)))


def _natural(name: str):
    from transformers.core_model_loading import dot_natural_key

    return dot_natural_key(name)


def _expert_stacked(name: str, ep_plan: Mapping[str, str]) -> bool:
    """True if transformers' expert-parallel plan shards this tensor's dim 0 by expert."""
    try:  # transformers 5.25 (vLLM 0.26 and 0.30's): one registry of TP and EP styles, EP's registered on import
        from transformers.distributed import expert_parallel  # noqa: F401
        from transformers.distributed.parallel_utils import ParallelInterface, _get_parameter_plan
    except ImportError:
        try:  # transformers 5.19 (vLLM 0.32's)
            from transformers.distributed.tensor_parallel import ParallelInterface, _get_parameter_plan
        except ImportError:  # transformers 5.16 (SkyRL 0.4.0's pin, in the vLLM 0.30 venv): the same lookup, TP-named
            from transformers.distributed.tensor_parallel import ParallelInterface
            from transformers.distributed.tensor_parallel import _get_parameter_tp_plan as _get_parameter_plan

    style = ParallelInterface._global_mapping.get(_get_parameter_plan(name, dict(ep_plan)) or "")
    return bool(getattr(style, "shards_expert_dim", False))


def trainer_specs(config_dir: Path, fmt: TrainerFormat, dtype: torch.dtype) -> list[TensorEntry]:
    """The trainer tensors of this format, in feeding order."""
    return load_trainer_model(config_dir, dtype).specs(fmt)
