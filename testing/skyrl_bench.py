"""The SkyRL entry of benchmarks/bench_frameworks.py: SkyRL 0.4.0's weight sync, weightplan against its own path."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from weightplan.testing.engines import ROOT
from weightplan.testing.fsdp2_policy import fsdp2_llama, train_step

CONFIG = ROOT / "tests" / "configs" / "engine-llama"  # the model of tests/frameworks/test_skyrl.py
SERVER_URL = "http://127.0.0.1:8000"  # SkyRL's one inference server, as its client is handed it (stood in below)


def skyrl_missing() -> str | None:
    """Why SkyRL's entry cannot run in this interpreter, or None."""
    try:
        import ray  # noqa: F401  (SkyRL's trainer-side weight sync imports it)
        import skyrl  # noqa: F401
    except ImportError as missing:
        return (f"the skyrl entry needs SkyRL 0.4.0 and ray ({missing}), installed only in the vLLM 0.30 venv: "
                "run it with .venv-vllm-0.30.0/bin/python (make bench-frameworks-skyrl)")
    return None


class SkyrlDefaultPath:
    """SkyRL's default (`nccl`) path as far as it runs on a CPU: its `FsdpWeightSource` iterated (every parameter
    `full_tensor()`ed and cast to the model dtype, what SkyRL's NCCL sender broadcasts) into vLLM's `load_weights` of a
    loader-built model (what vLLM's NCCL receive engine calls with what it receives). The broadcast itself needs CUDA;
    a live CPU engine's `load_weights` changes nothing it computes (docs/frameworks.md), so a loader-built model
    stands in for the engine, as in the TRL and verl baselines."""

    def __init__(self, config: Path, policy: torch.nn.Module):
        from skyrl.backends.skyrl_train.weight_sync.sources import FsdpWeightSource

        from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config

        self.vllm_config = make_vllm_config(config)  # a model of its own needs its own VllmConfig (layer names)
        self.model = build_model(self.vllm_config, "cpu")
        self.source = FsdpWeightSource(policy, torch.bfloat16, "")

    def sync(self) -> float:
        """One sync's seconds."""
        from weightplan.compiler.frontend.vllm_patches import parallel_rank

        start = time.perf_counter()
        with torch.no_grad(), parallel_rank(self.vllm_config, 0, 0):
            self.model.load_weights(iter(self.source))
        return time.perf_counter() - start

    def digests(self) -> dict[str, str]:
        from weightplan.compiler.frontend.vllm_compat import compute_tensor_digests

        return compute_tensor_digests(self.model)


def run_skyrl(steps: int, workdir: Path) -> dict:
    """`steps` AdamW steps of an FSDP2 policy, each followed by SkyRL's `send_weights()` through weightplan into a live
    vLLM engine and by SkyRL's default path (SkyrlDefaultPath). Returns each path's seconds per step, whether every
    step the engine held exactly vLLM's own load of the gathered state, and whether the default path loaded the same.
    One line per step on stdout; the plan and the layout go in `workdir`/weightplan."""
    from skyrl.backends.skyrl_train.weight_sync import weight_senders
    from skyrl.backends.skyrl_train.weight_sync.sources import FsdpWeightSource
    from skyrl.train.config.config import InferenceEngineConfig
    from torch.distributed.tensor import DTensor

    from weightplan.adapters import skyrl as adapter
    from weightplan.runtime import load_plan
    from weightplan.testing.engines import make_llm, pin_no_amx, shutdown, staged_digests
    from weightplan.testing.rl_inference import FreshLoad
    from weightplan.vllm_backend.clients import LLMClient

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(staged_digests): the check only
    unpin = pin_no_amx(workdir)
    llm = make_llm(CONFIG, dummy=True, backend=True)
    engine, sky_client = None, weight_senders.SkyrlWeightSyncClient
    try:
        judge = FreshLoad(CONFIG)  # vLLM's own load_weights of the gathered state (it makes the one-rank world)
        policy = fsdp2_llama(str(CONFIG))
        optimizer = torch.optim.AdamW(policy.parameters(), lr=0.05)
        default_path = SkyrlDefaultPath(CONFIG, policy)
        adapter.install(adapter.WeightplanSettings(workdir=str(workdir / "weightplan"), job="skyrl-bench"))

        def client(server_urls, data_parallel_size, *, init_payload_fn=None):
            # SkyRL's client speaks HTTP to SkyRL's vLLM server actors (Ray, GPUs); the in-process engine's client
            # makes the same four calls
            return LLMClient(llm)

        weight_senders.SkyrlWeightSyncClient = client
        start = time.perf_counter()
        engine = weight_senders.build_trainer_engine(
            ie_cfg=InferenceEngineConfig(weight_sync_backend="weightplan", model_dtype="bfloat16"), colocate_all=False,
            rank=0, inference_world_size=1, source_factory=lambda dtype, backend: FsdpWeightSource(policy, dtype, ""),
            draft_source_factory=None, server_urls=[SERVER_URL], data_parallel_size=1, base_model_path=str(CONFIG))
        init_s = time.perf_counter() - start
        plan = load_plan(engine.init_info.plan)
        ours, theirs, identical, baseline_identical = [], [], True, True
        for step in range(1, steps + 1):
            train_step(policy, optimizer)
            start = time.perf_counter()
            engine.send_weights()  # what SkyRL's Worker._sync_weights_to_inference_engines calls
            ours.append(time.perf_counter() - start)
            theirs.append(default_path.sync())
            full = {name: DTensor.full_tensor(t).detach() for name, t in policy.state_dict().items()}
            expected, staged = judge.digests(full, plan), llm.collective_rpc(staged_digests)[0]
            differ = sorted(k for k in staged if expected.get(k) != staged[k])
            identical &= bool(staged) and not differ and engine.version == step
            ours_loaded = default_path.digests()
            baseline_differ = sorted(k for k in expected if ours_loaded.get(k) != expected[k])
            baseline_identical &= not baseline_differ
            print(json.dumps({"event": "step", "step": step, "update_s": round(ours[-1], 4),
                              "baseline_s": round(theirs[-1], 4), "digests": len(staged), "digests_differ": differ[:5],
                              "baseline_digests_differ": baseline_differ[:5]}), flush=True)
        return {"ours": ours, "theirs": theirs, "identical": identical, "baseline_identical": baseline_identical,
                "init_s": init_s, "parameters": sum(p.numel() for p in policy.parameters())}
    finally:
        weight_senders.SkyrlWeightSyncClient = sky_client
        if engine is not None:
            weight_senders.teardown_engine(engine)
        adapter.uninstall()
        shutdown(llm)
        unpin()
