"""verl's weight sync through weightplan: the `weightplan` checkpoint engine (`rollout.checkpoint_engine.backend`)."""

from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from .live_plan import broadcast_json, compile_live_plan
from .live_plan import group_device as _group_device
from .settings import PublishSettings
from .startup import replica_job, start_engine, trainer_init_info

TESTED_VERL = "0.9.1"
BACKEND = "weightplan"
PLAN_KEY = "verl/plan"  # the compiled plan's path, put by the master trainer in the rendezvous store
# What actor_shards reads without running it: the generator this function returns is built over the actor's DTensor
# state dict (tests/frameworks/test_shims.py fails when a verl release changes the function).
SHIMMED = {
    "verl.workers.engine.fsdp.transformer_impl:FSDPEngine.get_per_tensor_param":
        "30802c73cfcc5ba2d16c8e1936713bdb47cdc12d78abe0884d7e4f2ff293e8c3",
}

# A process that hosts its own vLLM engine (a CPU test, an in-process rollout) names it here, by replica index, as a
# four-method VLLMWeightSyncClient (weightplan.vllm_backend.clients); otherwise the rollout leader drives verl's vLLM
# server actor (`RayServerClient`).
ROLLOUT_CLIENTS: dict[int, Any] = {}


@dataclass
class WeightplanSettings(PublishSettings):
    """`rollout.checkpoint_engine.engine_kwargs.weightplan`; every field has a default but `model` (with `plan=None`).

    `plan`: a compiled plan (trainer layout against one rollout replica's layout); None: the master trainer writes the
    actor's layout at the first sync and runs `compile-plan --model MODEL --trainer-format stacked --inference INFERENCE`
    (`model`: the HF config directory, e.g. `${actor_rollout_ref.model.path}`; `inference`: e.g.
    `tp=${actor_rollout_ref.rollout.tensor_model_parallel_size}`). The plan path must be readable by the rollout
    leaders (a shared `workdir` across nodes). `address`: the rendezvous store the master trainer serves (port 0: a free
    one; off loopback it needs a job secret, docs/runtime.md, "Threat model"). `job`, `timeout`, `verify`, `delta`: as the vLLM
    backend's (docs/vllm.md).
    """

    job: str = "verl"
    model: str | None = None
    inference: str = "tp=1"

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "WeightplanSettings":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown weightplan checkpoint-engine setting(s) {unknown}: engine_kwargs.weightplan takes "
                             f"{sorted(known)}")
        return cls(**kwargs)

    @property
    def replica_ranks(self) -> int:
        """Inference ranks (vLLM workers) per rollout replica: tp x dp of `inference`."""
        layout = dict(part.split("=", 1) for part in self.inference.split(",") if "=" in part)
        return int(layout.get("tp", 1)) * int(layout.get("dp", 1))


@CheckpointEngineRegistry.register(BACKEND)
class WeightplanCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine that syncs by a weightplan plan.

    Actor side (verl builds it with `is_master`): `send_weights` publishes version `global_steps` with a LiveSender
    over this rank's own FSDP2 shards, one job per rollout replica, and waits until the replica's vLLM workers have
    read it. It never iterates the full-tensor generator verl hands it: it takes the actor's DTensor state dict that
    generator was built over (verl's FSDP2 `get_per_tensor_param()`), or the module of a training engine passed instead.
    Rollout side (verl builds it without `is_master`): the leader of each replica drives its vLLM engine's
    weight-transfer API (backend `weightplan`: the workers pull by the plan into their own parameters) while verl's
    server adapter iterates `receive_weights`, which yields nothing.
    """

    # verl 0.9.1's vLLM server adapter accepts only "named_tensors" and "delta_flush"; with "named_tensors" and nothing
    # yielded it runs an empty IPC round after our pull (docs/frameworks.md#verl: the one-line change that skips it).
    wire_format = "named_tensors"

    def __init__(self, bucket_size: int = 0, is_master: bool | None = None, **kwargs) -> None:
        self.bucket_size = bucket_size
        self.is_master = bool(is_master)
        self.role = "rollout" if is_master is None else "actor"  # verl passes is_master to its actors' engines only
        self.settings = WeightplanSettings.from_kwargs(kwargs)
        self.topology: dict[str, Any] = {}
        self.store = None  # the master's served rendezvous (kept for the job's life)
        self.trainer_engines: list | None = None
        self.rollout_client = None
        self.rollout_initialized = False
        self.plan_path: str | None = None
        self.version = 0

    # -- verl's per-step protocol -------------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Actor master: serve the rendezvous store (once) and return its address; rollout: its replica layout."""
        if self.role == "rollout":
            return {"role": "rollout", "replica_ranks": self.settings.replica_ranks}
        if self.is_master and self.store is None:
            from weightplan.runtime import Rendezvous

            self.store = Rendezvous.connect(self.settings.job, self.settings.address, serve=True,
                                            timeout=self.settings.timeout)
        return {"role": "actor", "address": self.store.address if self.store is not None else None}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        """Every worker learns the store; rollout worker i belongs to replica i // (its ranks per replica) and the first of each drives it."""
        address = next((m.get("address") for m in metadata[:actor_wg_world_size] if m.get("address")), None)
        if address is None:
            raise RuntimeError("no actor worker served the weightplan rendezvous store: the actor's checkpoint engine "
                               "was built without is_master=True on rank 0")
        size = max(int(m.get("replica_ranks", 1)) for m in metadata[actor_wg_world_size:]) if rollout_world_size else 1
        if rollout_world_size % size:
            raise RuntimeError(f"{rollout_world_size} rollout workers are not whole replicas of {size} ranks each "
                               "(engine_kwargs.weightplan.inference)")
        replicas = rollout_world_size // size
        actor = {"address": [address] * actor_wg_world_size, "replicas": [replicas] * actor_wg_world_size}
        rollout = {"address": [address] * rollout_world_size, "replicas": [replicas] * rollout_world_size,
                   "replica": [i // size for i in range(rollout_world_size)],
                   "drives": [i % size == 0 for i in range(rollout_world_size)]}
        return actor, rollout

    def init_process_group(self, **kwargs) -> None:
        if self.topology and self.topology.get("replicas") != kwargs.get("replicas"):
            raise RuntimeError("the rollout replicas changed between syncs; weightplan's verl engine serves a fixed set "
                               "of replicas (restart the job after scaling)")
        self.topology = kwargs

    def finalize(self) -> None:
        """Nothing to free per step: the registered shards, the NIXL agents and the store live across syncs."""

    async def send_weights(self, weights, global_steps: int | None = None):
        """Publish version `global_steps` from this rank's shards (never `full_tensor()`), and wait until it is read."""
        version = global_steps if global_steps is not None else self.version + 1
        first = self.trainer_engines is None
        if first:
            self.trainer_engines = self._start_trainer_engines(actor_shards(weights))
        # One replica after another: sending to them at once from threads (one NIXL agent each) timed out at UCX
        # wire-up (docs/frameworks.md, "Several replicas").
        for engine in self.trainer_engines:  # every rank walks the replicas in the same order
            if first:  # a release waits only for the readers joined when it starts: the rollout joins at its first pull
                await asyncio.to_thread(_await_readers, engine, self.settings.timeout)
            await asyncio.to_thread(engine.send_weights, version)
        self.version = version
        return {"weightplan/version": version}

    async def receive_weights(self, global_steps: int | None = None):
        """The replica leader drives its engine's pull of version `global_steps`; nothing is yielded to verl."""
        version = global_steps if global_steps is not None else self.version + 1
        if self.topology.get("drives"):
            await asyncio.to_thread(self._pull, version)
        self.version = version
        return
        yield  # an async generator: verl's server adapter iterates it (and loads nothing)

    # -- actor side ---------------------------------------------------------------------------------------------
    def _start_trainer_engines(self, shards) -> list:
        s = self.settings
        address = self.topology.get("address")
        if address is None:
            raise RuntimeError("weightplan's verl engine: send_weights before init_process_group (verl's "
                               "CheckpointEngineManager runs prepare, build_topology and init_process_group first)")
        rank = dist.get_rank() if dist.is_initialized() else 0
        shared = {}
        if self.is_master:
            plan = s.plan or self._compile_plan(shards)
            if not Path(plan).is_file():
                raise FileNotFoundError(f"weightplan's verl engine: plan {plan} does not exist (engine_kwargs.weightplan"
                                        ".plan, or leave it unset with `model` set to compile one at the first sync)")
            shared = {"plan": str(Path(plan).resolve())}
            self.store.put(PLAN_KEY, shared)
        shared = broadcast_json(shared, _group_device())
        self.plan_path = shared["plan"]
        engines = []
        for j in range(int(self.topology.get("replicas", 1))):
            info = trainer_init_info(s, rank=rank, plan=self.plan_path, address=address, job=replica_job(s.job, j),
                                     serve_store=False, drives=False)
            engines.append(start_engine(info, shards))
        return engines

    def _compile_plan(self, shards) -> str:
        """The master trainer: the actor's layout, compiled against one rollout replica (adapters/live_plan.py)."""
        s = self.settings
        if not s.model:
            raise ValueError("weightplan's verl engine needs engine_kwargs.weightplan.model (the HF model directory, "
                             "e.g. ${actor_rollout_ref.model.path}) to compile a plan, or a compiled plan in .plan")
        return compile_live_plan(_named(shards), s.model, s.inference, s.workdir, "verl.plan")

    # -- rollout side -------------------------------------------------------------------------------------------
    def _pull(self, version: int) -> None:
        client = self._client()
        if not self.rollout_initialized:
            self._init_engine(client)
        client.start_weight_update()
        client.update_weights({"version": version})
        client.finish_weight_update(weight_version=str(version))

    def _client(self):
        if self.rollout_client is None:
            replica = int(self.topology.get("replica", 0))
            self.rollout_client = ROLLOUT_CLIENTS.get(replica) or RayServerClient(replica)
        return self.rollout_client

    def _init_engine(self, client) -> None:
        from weightplan.runtime import Rendezvous, load_plan

        s = self.settings
        backend = engine_backend(client)
        if backend not in (None, BACKEND):
            raise RuntimeError(f"rollout replica {self.topology.get('replica', 0)}'s vLLM engine runs weight-transfer "
                               f"backend {backend!r}; start it with rollout.engine_kwargs.vllm.weight_transfer_config: "
                               "{backend: weightplan}")
        rendezvous = Rendezvous.connect(s.job, self.topology["address"], timeout=s.timeout)
        rendezvous.wait([PLAN_KEY], s.timeout, "the master trainer's plan")
        plan_path = plan_of(rendezvous.get_json(PLAN_KEY))
        job = replica_job(s.job, int(self.topology.get("replica", 0)))
        info = trainer_init_info(s, rank=0, plan=plan_path, address=self.topology["address"], job=job)
        client.init_weight_transfer_engine(info.worker_init_info(load_plan(plan_path).fingerprint))
        self.plan_path, self.rollout_initialized = plan_path, True

    def shutdown(self) -> None:
        for engine in self.trainer_engines or ():
            engine.shutdown()
        self.trainer_engines = None


class RayServerClient:
    """verl's vLLM server actor for replica `replica` (`vllm_server_<replica>_0`) as a VLLMWeightSyncClient: vLLM's
    weight-transfer calls as `collective_rpc` on its workers, the way verl's own delta path drives them."""

    def __init__(self, replica: int, prefix: str = "vllm_") -> None:
        import ray

        self.ray = ray
        self.server = ray.get_actor(f"{prefix}server_{replica}_0")

    def _rpc(self, method: str, **kwargs) -> None:
        self.ray.get(self.server.collective_rpc.remote(method, kwargs=kwargs))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._rpc("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        self._rpc("start_weight_update")

    def update_weights(self, update_info) -> None:
        self._rpc("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._rpc("finish_weight_update")


def _await_readers(engine, timeout: float) -> None:
    """Until every inference rank reading this trainer's plan joined its job (the rollout leader's first pull)."""
    from weightplan.runtime.transport import protocol

    sender = engine.sender
    keys = [protocol.joined_key(rank) for rank in sender.readers]
    deadline = time.monotonic() + timeout
    while not all(sender.rendezvous.exists(key) for key in keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"weightplan's verl engine: the rollout's vLLM workers did not join job "
                               f"{engine.init_info.job} within {timeout} s (is the rollout side's checkpoint engine "
                               "`weightplan` too, and its vLLM server started with the weightplan backend?)")
        time.sleep(0.01)


def plan_of(record: dict) -> str:
    """The plan path in the master trainer's PLAN_KEY record, or a SyncError naming the key and what is wrong."""
    from weightplan.runtime import SyncError

    plan = record.get("plan")
    if set(record) != {"plan"} or not isinstance(plan, str) or not plan:
        raise SyncError(f"weightplan's verl engine: rendezvous key {PLAN_KEY!r} holds {str(record)[:80]}, not "
                        "{'plan': <the compiled plan's path>} as the master trainer writes it")
    return plan


def engine_backend(client) -> str | None:
    """The weight-transfer backend of the engine behind `client`, where it can be read in-process (else None)."""
    llm = getattr(client, "llm", None) or getattr(client, "engine", None)
    config = getattr(getattr(llm, "llm_engine", llm), "vllm_config", None)
    transfer = getattr(config, "weight_transfer_config", None)
    if config is None:
        return None
    return getattr(transfer, "backend", None) if transfer is not None else "none"


def actor_shards(weights):
    """This rank's trainer tensors, without gathering: a module, or {name: DTensor or tensor}.

    Takes a module, a training engine with `.module` (what verl passes its delta engine), a state dict, or the lazy
    generator verl's FSDP2 engine returns from `get_per_tensor_param()` (its `(name, param.full_tensor())` pairs are
    built over the actor's DTensor state dict, which is found without running the generator).
    """
    if isinstance(weights, torch.nn.Module):
        return weights
    module = getattr(weights, "module", None)
    if isinstance(module, torch.nn.Module):
        return module
    if isinstance(weights, dict):
        return weights
    found = _state_dict_behind(weights)
    if found is None:
        raise TypeError(f"weightplan's verl engine publishes from the actor's own shards, and cannot find them behind "
                        f"{type(weights).__name__}: it takes verl's FSDP2 get_per_tensor_param() generator (not yet "
                        "started), a training engine with .module, or a module")
    return found


def _state_dict_behind(obj, depth: int = 4):
    """The dict of DTensors a (not yet started) generator chain iterates over: generator locals, then the dict under a
    dict iterator (gc.get_referents)."""
    from torch.distributed.tensor import DTensor

    if depth < 0 or obj is None:
        return None
    if isinstance(obj, dict):
        return obj if obj and any(isinstance(v, DTensor) for v in obj.values()) else None
    frame = getattr(obj, "gi_frame", None) or getattr(obj, "ag_frame", None)
    if frame is not None:
        for value in frame.f_locals.values():
            found = _state_dict_behind(value, depth - 1)
            if found is not None:
                return found
        return None
    if type(obj).__name__.endswith("iterator") and "dict" in type(obj).__name__:  # dict_/odict_ item/value iterators
        for ref in gc.get_referents(obj):
            found = _state_dict_behind(ref, depth - 1)
            if found is not None:
                return found
    return None


def _named(shards):
    return shards.state_dict().items() if isinstance(shards, torch.nn.Module) else shards.items()
