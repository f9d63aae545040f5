"""Toy --trainer-adapter factories over transformers' Llama tensors: renamed, computing, or broken."""

from __future__ import annotations

from pathlib import Path

import torch

from weightplan.compiler.frontend.trainer_formats import TrainerFormat, load_trainer_model


class Renamed:
    """The checkpoint tensors under a `trainer.` prefix, transposed on the trainer side: to_hf undoes both."""

    def __init__(self, config_dir: Path, dtype: torch.dtype):
        self._checkpoint = load_trainer_model(config_dir, dtype).specs(TrainerFormat.HF)

    def state_dict(self):
        return {f"trainer.{s.name}": torch.empty(tuple(reversed(s.shape)), dtype=getattr(torch, s.dtype), device="meta")
                for s in self._checkpoint}

    def to_hf(self, state_dict):
        return {name.removeprefix("trainer."): t.t() if t.dim() == 2 else t for name, t in state_dict.items()}


class Computing(Renamed):
    def to_hf(self, state_dict):
        return {name: t * 2 for name, t in super().to_hf(state_dict).items()}


class ReturnsList(Renamed):
    def to_hf(self, state_dict):
        return list(state_dict.values())


class NoToHf:
    def __init__(self, config_dir, dtype):
        pass

    def state_dict(self):
        return {"w": torch.empty(2, device="meta")}


def raising(config_dir, dtype):
    raise RuntimeError("no such model")


not_callable = 3
