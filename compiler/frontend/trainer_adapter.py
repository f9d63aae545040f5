"""A trainer that is not a transformers model: its state dict mapped to checkpoint tensors by a user adapter, traced.

`--trainer-adapter module:callable` names a factory `callable(config_dir, dtype)` returning an
object with `state_dict()` (the trainer's tensors under its own names; meta tensors suffice) and
`to_hf(state_dict)` (its checkpoint tensors, as torchtitan's `StateDictAdapter.to_hf` returns
them), and optionally `is_expert(name)` (routed experts stacked on dim 0, for expert
parallelism). `to_hf` runs on LazyWeights like transformers' conversion: every op it uses is
recorded or refused by name.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..ir import TensorEntry
from weightplan.runtime.errors import WeightplanError
from .errors import ModelConfigError
from .lazy_weight import dtype_name
from .trainer_formats import TrainerFormat
from .vllm_patches import check_unpatched

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True, eq=False)
class AdapterTrainer:
    """The trainer tensors and checkpoint conversion of one adapter (the interface of TrainerModel)."""

    spec: str
    adapter: object
    tensors: dict[str, torch.Tensor]

    def specs(self, fmt: TrainerFormat = TrainerFormat.ADAPTER) -> list[TensorEntry]:
        is_expert = getattr(self.adapter, "is_expert", lambda name: False)
        return [TensorEntry(name, tuple(t.shape), dtype_name(t.dtype), "expert" if is_expert(name) else "dense")
                for name, t in self.tensors.items()]

    def checkpoint_tensors(self, fmt: TrainerFormat, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapter's `to_hf` of every trainer tensor in `pairs` (given all at once: it may combine them)."""
        given = dict(pairs)
        try:
            converted = self.adapter.to_hf(given)
        except WeightplanError:  # the tracer refused an op, naming it
            raise
        except Exception as exc:
            raise ModelConfigError(f"trainer adapter {self.spec}: to_hf failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(converted, dict):
            raise ModelConfigError(f"trainer adapter {self.spec}: to_hf returned {type(converted).__name__}, not a dict")
        for name, tensor in converted.items():
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise ModelConfigError(f"trainer adapter {self.spec}: to_hf returned {name!r}: {type(tensor).__name__}, "
                                       "not a checkpoint name and a tensor")
            yield name, tensor


def check_adapter_spec(spec: str) -> None:
    if not isinstance(spec, str) or not _SPEC.match(spec):
        raise ModelConfigError(f"--trainer-adapter {spec!r}: give module:callable, e.g. "
                               "weightplan.compiler.trainer_adapters.torchtitan:TorchtitanDeepSeekV3")


def load_adapter(spec: str, config_dir: Path, dtype: torch.dtype) -> AdapterTrainer:
    """Import `module:callable`, build the adapter for this config, and read its state dict (one-line errors)."""
    check_adapter_spec(spec)
    check_unpatched(f"building the trainer adapter {spec}")
    module_name, attr = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ModelConfigError(f"--trainer-adapter {spec}: cannot import {module_name}: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelConfigError(f"--trainer-adapter {spec}: {module_name} has no callable {attr}")
    try:
        adapter = factory(Path(config_dir), dtype)
        tensors = adapter.state_dict()
    except Exception as exc:
        raise ModelConfigError(f"--trainer-adapter {spec}: building the adapter for {config_dir} failed: "
                               f"{type(exc).__name__}: {exc}") from None
    if not callable(getattr(adapter, "to_hf", None)):
        raise ModelConfigError(f"--trainer-adapter {spec}: the adapter has no to_hf(state_dict) method")
    if not isinstance(tensors, dict) or not tensors or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        raise ModelConfigError(f"--trainer-adapter {spec}: state_dict() must return a non-empty dict of named tensors")
    return AdapterTrainer(spec, adapter, {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()})
