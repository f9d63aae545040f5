"""The TRL code weightplan.adapters.trl stands in for is the code it was written against (TRL 1.16.0), by source hash."""

from __future__ import annotations

import hashlib
import importlib
import inspect

import pytest

trl_adapter = pytest.importorskip("weightplan.adapters.trl")


@pytest.mark.parametrize("target", sorted(trl_adapter.SHIMMED))
def test_shimmed_trl_function_is_unchanged(target):
    """A TRL release that edits one of these fails here: re-read it against the shim, then update SHIMMED."""
    module_name, _, qualname = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    digest = hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()
    assert digest == trl_adapter.SHIMMED[target], f"{target} changed in this TRL; the weightplan shim was read against " \
                                                  f"TRL {trl_adapter.TESTED_TRL}"


def test_grpo_trainer_builds_its_generation_by_the_swapped_global():
    """WeightplanGRPOTrainer swaps `trl.trainer.grpo_trainer.VLLMGeneration` while GRPOTrainer.__init__ runs."""
    from trl.trainer import grpo_trainer

    assert "self.vllm_generation = VLLMGeneration(" in inspect.getsource(grpo_trainer.GRPOTrainer.__init__)
    sentinel = object()
    with trl_adapter._swapped(grpo_trainer, "VLLMGeneration", sentinel):
        assert grpo_trainer.VLLMGeneration is sentinel
    assert grpo_trainer.VLLMGeneration is trl_adapter.VLLMGeneration
    assert issubclass(trl_adapter.WeightplanGRPOTrainer, grpo_trainer.GRPOTrainer)
