"""The weightplan backend behind `vllm serve` (dev-mode RL routes), driven by vLLM's own HTTP client: one update.

Slow (one more engine start): runs when WEIGHTPLAN_SLOW_ENGINE=1 (`make test-engine-slow`).
"""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from weightplan.testing.engines import (
    CONFIGS, first_reference, full_weights, local_shards, pin_no_amx, plan_and_first_reference, start_server,
)

from ..support.serve_http import SERVED_MODEL as MODEL, served_tokens

pytestmark = pytest.mark.skipif(os.environ.get("WEIGHTPLAN_SLOW_ENGINE") != "1",
                                reason="slow engine test: set WEIGHTPLAN_SLOW_ENGINE=1 (make test-engine-slow)")


def test_one_update_through_vllm_serve_http_routes(tmp_path):
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    from weightplan.vllm_backend.trainer import ShardSource, WeightplanTrainerEngine, WeightplanTrainerInitInfo

    unpin = pin_no_amx(tmp_path)
    plan_path, plan, refs = plan_and_first_reference(MODEL, tmp_path)
    server, base = start_server(CONFIGS / MODEL, tmp_path / "serve.log")
    try:
        cold = served_tokens(base)
        tensors = local_shards(plan, full_weights(plan, 0, 1), 0)
        info = WeightplanTrainerInitInfo(rank=0, plan=str(plan_path), address="127.0.0.1:0", job="serve", timeout=60)
        trainer = WeightplanTrainerEngine.trainer_init(info, client=HTTPVLLMWeightSyncClient(base),
                                                       source=ShardSource(tensors))
        trainer.send_weights()
        expected = [tokens for tokens, _ in first_reference(refs, tmp_path)]
        assert cold != expected
        assert served_tokens(base) == expected
        with urllib.request.urlopen(f"{base}/weight_info", timeout=10) as response:
            assert json.loads(response.read())["weight_version"] == "1"
        trainer.shutdown()
    finally:
        server.terminate()
        server.wait(60)
        unpin()
