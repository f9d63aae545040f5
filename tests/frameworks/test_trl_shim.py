"""How weightplan.adapters.trl swaps TRL's module globals (the hashes of the TRL code it shims: test_shims.py)."""

from __future__ import annotations

import inspect

import pytest

trl_adapter = pytest.importorskip("weightplan.adapters.trl")


def test_grpo_trainer_builds_its_generation_by_the_swapped_global():
    """WeightplanGRPOTrainer swaps `trl.trainer.grpo_trainer.VLLMGeneration` while GRPOTrainer.__init__ runs."""
    from trl.trainer import grpo_trainer

    assert "self.vllm_generation = VLLMGeneration(" in inspect.getsource(grpo_trainer.GRPOTrainer.__init__)
    sentinel = object()
    with trl_adapter._swapped(grpo_trainer, "VLLMGeneration", sentinel):
        assert grpo_trainer.VLLMGeneration is sentinel
    assert grpo_trainer.VLLMGeneration is trl_adapter.VLLMGeneration
    assert issubclass(trl_adapter.WeightplanGRPOTrainer, grpo_trainer.GRPOTrainer)
