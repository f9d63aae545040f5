"""Under vLLM 0.26 and 0.30: the runtime syncs plans traced by it, and the backend refuses a plan traced by another vLLM."""

from __future__ import annotations

import pytest

from . import UNDER_A_COMPAT_VLLM, VLLM
from ..conftest import config_dir, with_header_edit
from ..support.pairs import assert_equal_to_host, in_process_pair

pytestmark = UNDER_A_COMPAT_VLLM


@pytest.mark.parametrize("model,inference", [("tiny-qwen3-moe", "tp=1"), ("tiny-qwen3-moe", "dp=2,ep"),
                                             ("tiny-llama", "tp=2")])
def test_an_in_process_sync_of_a_plan_traced_by_this_vllm_writes_what_the_host_executor_writes(plan_cache, rendezvous, model,
                                                                                    inference):
    from weightplan.runtime import load_plan

    plan = load_plan(plan_cache(model, "hf", "bf16", "fsdp=1", inference))  # one trainer rank: in_process_pair
    assert plan.header.vllm_version == VLLM
    tensors, sender, destination, receiver = in_process_pair(plan, rendezvous, verify=True)
    try:
        sender.publish(1)
        report = receiver.sync(1)
        assert receiver.version == 1 and report.bytes == sum(e.nbytes for e in plan.dests if 0 in e.ranks)
        assert_equal_to_host(plan, destination, 1)
    finally:
        receiver.close()
        sender.close()


def test_the_backend_refuses_a_plan_traced_by_another_vllm_in_one_line(plan_cache, tmp_path):
    from weightplan.compiler.frontend.vllm_model import make_vllm_config
    from weightplan.runtime import load_plan
    from weightplan.vllm_backend.engine_check import _layout_problems

    path = plan_cache("tiny-llama")
    other = tmp_path / "traced-by-0.32.plan"
    other.write_bytes(with_header_edit(path.read_bytes(), lambda header: header.update(vllm_version="0.32.0")))
    config = make_vllm_config(config_dir("tiny-llama"))
    assert _layout_problems(load_plan(path), 0, config, "cpu", config.model_config) == []
    assert _layout_problems(load_plan(other), 0, config, "cpu", config.model_config) == [
        f"vLLM version: plan compiled with 0.32.0, engine runs {VLLM}"]
