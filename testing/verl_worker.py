"""verl's default weight sync on CPU, the baseline testing/verl_ray.py's weightplan run is measured against.

    python -m weightplan.testing.verl_worker --rank R --address HOST:PORT --master-port P --workdir DIR [--steps N]
    run_workers(workdir, *options)   # the 4 actor ranks of a (dp_shard=2, ep=2) mesh

Each step: one optimizer step on testing/moe_trainer.py's toy objective, then verl's `naive` checkpoint engine
(`ColocatedCheckpointEngine`, verl's default) over verl's FSDP `get_per_tensor_param()` (every rank `full_tensor()`s
every parameter), whose full tensors rank 0 loads with vLLM's `load_weights` into a loader-built model (verl loads them
into its colocated engine over CUDA IPC; a live CPU engine refuses `load_weights`). JSON lines on stdout.
Also the pieces both verl runs share: the checkpoint-engine config and verl's `FSDPEngine` around the FSDP2 model.
"""

from __future__ import annotations

import argparse
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
    """The actor ranks to completion (one failing fails the call, with its stderr); their stdout."""
    from weightplan.runtime import Rendezvous

    store = Rendezvous.connect("verl-workers", "127.0.0.1:0", serve=True, timeout=60)
    port = free_port()
    common = ["--address", store.address, "--master-port", str(port), "--workdir", str(workdir), *options]
    procs, names = [], []
    for rank in range(ACTORS):
        name = f"actor{rank}"
        procs.append(subprocess.Popen([sys.executable, "-m", "weightplan.testing.verl_worker", "--rank", str(rank),
                                       *common], cwd=ROOT, stdout=open(workdir / f"{name}.out", "w"),
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


def engine_kwargs(workdir: Path, inference: str = "tp=1") -> dict:
    return {"model": str(mt.ENGINE_CONFIG), "inference": inference, "job": JOB, "workdir": str(workdir), "timeout": 120}


def checkpoint_config(workdir: Path, backend: str = "weightplan", inference: str = "tp=1"):
    from verl.workers.config import CheckpointEngineConfig

    return CheckpointEngineConfig(backend=backend, custom_backend_module="weightplan.adapters.verl",
                                  engine_kwargs={"weightplan": engine_kwargs(workdir, inference)})


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
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs
    from vllm.distributed import init_distributed_environment

    from weightplan.runtime import Rendezvous
    from weightplan.testing.rl_inference import FreshLoad

    store = Rendezvous.connect("verl-workers", args.address, timeout=120)
    mt.init_trainer_group(args.rank, ACTORS, store)
    model = mt.build_model(mt.ENGINE_CONFIG)
    mt.parallelize(model, ep=2, param_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    actor = verl_fsdp_engine(model)
    config = checkpoint_config(args.workdir, "naive")
    # what ActorRolloutRefWorker.init_model does with the config
    import_external_libs(config.custom_backend_module)
    engine = CheckpointEngineRegistry.new(config.backend, is_master=args.rank == 0, bucket_size=1 << 20,
                                          **config.engine_kwargs.get(config.backend, {}))
    # vLLM's world group over the actors' group, as a colocated engine sets it up (TRLGather too)
    init_distributed_environment(world_size=ACTORS, rank=args.rank, local_rank=args.rank, backend="gloo")
    fresh = FreshLoad(mt.ENGINE_CONFIG) if args.rank == 0 else None
    for step in range(1, args.steps + 1):
        loss = mt.train_steps(model, optimizer, 1)
        torch.distributed.barrier()
        began = time.perf_counter()
        baseline_sync(actor, engine, fresh)
        seconds = time.perf_counter() - began
        print(json.dumps({"event": "step", "step": step, "rank": args.rank, "loss": loss, "update_s": round(seconds, 4)}),
              flush=True)
        torch.distributed.barrier()
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.update(RANK=str(args.rank), LOCAL_RANK=str(args.rank), WORLD_SIZE=str(ACTORS),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.master_port))
    actor_main(args)


if __name__ == "__main__":
    main()
