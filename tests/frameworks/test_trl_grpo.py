"""A TRL GRPO run switched to weightplan by its one setting: `WeightplanGRPOTrainer` in place of `GRPOTrainer`.

One process (TRL's colocate mode, its in-process vLLM CPU engine started on dummy weights with the weightplan
backend), transformers' DeepSeek-V3 for testing/configs/demo-deepseek-v3, a word-level tokenizer over its vocabulary,
two GRPO steps. TRL syncs before every generation; the engine's sampling logprobs then match the trainer's
(TRL's own `sampling/sampling_logp_difference`), which dummy weights would not. About 20 s here.
"""

from __future__ import annotations

from weightplan.testing import moe_trainer as mt
from weightplan.testing.trl_worker import ENGINE
from weightplan.testing.engines import pin_no_amx

from ..support.fake_world import run_in_fresh_process

STEPS = 2


def word_tokenizer(vocab_size: int):
    """A tokenizer whose words are t0..t{vocab_size-1}, one id each (the repo's configs ship no tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t1", eos_token="t2")


def test_grpo_trainer_with_the_one_line_switch_syncs_every_step_through_weightplan(tmp_path):
    """In a process of its own: TRL's colocate engine runs inside its trainer's process (vLLM's external launcher, which
    also sets VLLM_ENABLE_V1_MULTIPROCESSING=0 for the rest of that process), and an in-process vLLM CPU worker refuses
    to start beside the numba kernels other tests of this session loaded (vLLM's Triton dispatcher trips on llvmlite)."""
    run_in_fresh_process(_grpo_run, str(tmp_path))


def _grpo_run(tmp: str) -> None:
    from pathlib import Path

    from datasets import Dataset
    from trl import GRPOConfig

    from weightplan.adapters.trl import WeightplanGRPOTrainer, WeightplanSettings, WeightplanVLLMGeneration

    tmp_path = Path(tmp)
    unpin = pin_no_amx(tmp_path)
    model = mt.build_model(mt.ENGINE_CONFIG)
    model.name_or_path = str(mt.ENGINE_CONFIG)
    prompts = [" ".join(f"t{(7 * i + j) % 300 + 10}" for j in range(4)) for i in range(8)]
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_vllm=True, vllm_mode="colocate", per_device_train_batch_size=2,
                      num_generations=2, max_completion_length=4, max_steps=STEPS, report_to=[], use_cpu=True,
                      logging_steps=1, bf16=False, save_strategy="no", vllm_max_model_length=64)
    trainer = WeightplanGRPOTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
        reward_funcs=lambda completions, **_: [float(c.count("t17")) for c in completions],
        processing_class=word_tokenizer(model.config.vocab_size),
        weightplan=WeightplanSettings(llm_kwargs=ENGINE, workdir=str(tmp_path), job="grpo"))
    try:
        assert isinstance(trainer.vllm_generation, WeightplanVLLMGeneration)
        trainer.train()
        (engine,) = trainer.vllm_generation.trainer_engines
        assert engine.version == STEPS, "one sync per optimizer step"
        logs = [e for e in trainer.state.log_history if "sampling/sampling_logp_difference/max" in e]
        assert len(logs) == STEPS and all(float(e["sampling/sampling_logp_difference/max"]) < 0.05 for e in logs), logs
    finally:
        trainer.vllm_generation.close()
        unpin()
