"""TRL's server mode synced by weightplan: `vllm serve --weight-transfer-config '{"backend": "weightplan"}'` and 4 FSDP2
(dp_shard=2, ep=2) trainer ranks running TRL's VLLMGeneration (its VLLMClient generates; rank 0 drives the RL routes).

Slow (a server start and a fresh engine): runs when WEIGHTPLAN_SLOW_ENGINE=1 (`make test-engine-slow`). After three
steps the server generates what a fresh engine loaded from a checkpoint of the trainers' last state generates.
"""

from __future__ import annotations

import os

import pytest

from weightplan.testing import moe_trainer as mt
from weightplan.testing.trl_worker import run_trainers
from weightplan.testing.engines import pin_no_amx, read_references, start_references, start_server
from ..support.serve_http import served_tokens

pytestmark = pytest.mark.skipif(os.environ.get("WEIGHTPLAN_SLOW_ENGINE") != "1",
                                reason="slow engine test: set WEIGHTPLAN_SLOW_ENGINE=1 (make test-engine-slow)")
STEPS = 3


def test_trl_server_mode_three_steps_serve_what_a_fresh_engine_generates(tmp_path):
    unpin = pin_no_amx(tmp_path)
    server, base = start_server(mt.ENGINE_CONFIG, tmp_path / "serve.log")
    try:
        cold = served_tokens(base, str(mt.ENGINE_CONFIG))
        run_trainers(tmp_path, "--mode", "server", "--server", base, "--check", "--steps", str(STEPS))
        served = served_tokens(base, str(mt.ENGINE_CONFIG))
    finally:
        server.terminate()
        server.wait(60)
    try:
        refs = start_references({STEPS: tmp_path / f"checkpoint-{STEPS}"}, tmp_path / "refs.json", tmp_path / "refs.log")
        expected = [tokens for tokens, _ in read_references(refs, tmp_path / "refs.json", tmp_path / "refs.log")[STEPS]]
    finally:
        unpin()
    assert cold != expected
    assert served == expected
