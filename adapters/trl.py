"""TRL's GRPO weight sync through weightplan: `WeightplanGRPOTrainer`, and the `VLLMGeneration` subclass it runs."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any

from trl.generation import vllm_generation
from trl.generation.vllm_generation import VLLMClient, VLLMGeneration
from trl.trainer import grpo_trainer

from .live_plan import broadcast_json, compile_live_plan
from .settings import PublishSettings
from .startup import replica_job, start_engine, trainer_init_info

TESTED_TRL = "1.16.0"

# The TRL code this module stands in for or swaps a name inside, by SHA-256 of its source text; a TRL release that
# changes any of them fails tests/frameworks/test_shims.py until the shim is re-read against it.
SHIMMED = {
    "trl.generation.vllm_generation:VLLMGeneration._init_vllm":
        "0e584002e0f6a9c006aaec0e91ecc996ae8c0d3b2ff8491fbf08b484a57d20ce",
    "trl.generation.vllm_generation:VLLMGeneration.sync_weights":
        "63d669fb32304ff5e275443abc5e4a2c1e6974ba196d30074bc0f2519f98644c",
    "trl.trainer.grpo_trainer:GRPOTrainer.__init__":
        "18f01b7a46c9544b23d74e822bafa4cb087426c6285d549ebe7c1f58aa088801",
}

_SWAP = threading.RLock()  # the module-global swaps below are process-wide, and nest (trainer, then engine)


@dataclass
class WeightplanSettings(PublishSettings):
    """Where and how the trainers publish. Every field has a default; `plan=None` compiles one at the first sync.

    `plan`: a compiled plan for this trainer layout and engine layout; None: trainer rank 0 writes the live model's
    layout and compiles (`stacked` names, the masters' dtype, inference `tp=T`: T = `vllm_tensor_parallel_size` for
    colocated engines, each replica reading it in its own job, or the server's world size). `address`: the rendezvous store trainer rank 0 hosts (port 0: a free one).
    `workdir`: where the layout and compiled plan go (default a temporary directory). `llm_kwargs`: colocate mode's
    extra `vllm.LLM` arguments, over TRL's (e.g. `kv_cache_memory_bytes`, `load_format="dummy"`).
    """

    job: str = "trl"
    llm_kwargs: dict[str, Any] = field(default_factory=dict)


class WeightplanVLLMGeneration(VLLMGeneration):
    """TRL's VLLMGeneration whose `sync_weights` publishes this rank's own shards through a weightplan plan.

    Colocate mode: TRL's in-process `vllm.LLM` (one per `vllm_tensor_parallel_size` ranks) starts with the `weightplan`
    weight-transfer backend; each replica reads the plan in its own job, from every trainer rank, and the ranks it
    lives in drive it. Server mode: the server runs `vllm serve
    --weight-transfer-config '{"backend": "weightplan"}'` (dev mode routes), trainer rank 0 drives it over HTTP and
    TRL's NCCL communicator is never opened. No rank ever calls `full_tensor()`.
    """

    def __init__(self, *args, weightplan: WeightplanSettings | None = None, **kwargs) -> None:
        self.weightplan = weightplan or WeightplanSettings()
        self.trainer_engines: list | None = None
        self.plan_path: str | None = None
        super().__init__(*args, **kwargs)

    def _init_vllm(self) -> None:
        if self.mode == "server":
            self._init_server()
        elif self.mode == "colocate":
            if self.enable_sleep_mode:
                raise ValueError("weightplan's TRL adapter does not support vllm_enable_sleep_mode (level 2 frees the "
                                 "weights the plan writes into); set it to False")
            with _swapped(vllm_generation, "LLM", _llm_factory(vllm_generation.LLM, self.weightplan.llm_kwargs)):
                super()._init_vllm()
        else:
            super()._init_vllm()  # TRL's own one-line refusal of the mode

    def _init_server(self) -> None:
        """TRL's server branch without `init_communicator` (NCCL): a VLLMClient for generation on the main process."""
        if self.accelerator.is_main_process:
            base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            self.vllm_client = VLLMClient(base_url=base_url, group_port=self.group_port,
                                          connection_timeout=self.server_timeout)
            backend = (self.vllm_client.get_server_info().get("weight_transfer_config") or {}).get("backend")
            if backend != "weightplan":
                raise RuntimeError(f"the vLLM server at {base_url} runs weight-transfer backend {backend!r}; start it "
                                   """with --weight-transfer-config '{"backend": "weightplan"}'""")
        self.accelerator.wait_for_everyone()

    def sync_weights(self) -> None:
        """Publish the next version from this rank's shards; the engine(s) take it through vLLM's weight-transfer API."""
        if self.trainer_engines is None:
            self.trainer_engines = self._start_trainer_engines()
        for engine in self.trainer_engines:  # the same order on every rank: replica 0's engine first
            engine.send_weights()
        if self.mode == "colocate":
            self.llm.reset_prefix_cache()
        elif self.accelerator.is_main_process:
            self.vllm_client.reset_prefix_cache()

    def _start_trainer_engines(self) -> list:
        """This rank's trainer engines: one per engine replica (colocate mode: world / tp of them, each in its own
        job, driven by the rank it lives in; server mode: the server's, driven by rank 0). Rank 0 hosts the store."""
        from accelerate.utils import is_peft_model
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

        from weightplan.vllm_backend.clients import LLMClient

        if is_peft_model(self.model):
            raise ValueError("weightplan's TRL adapter syncs full models; with a PEFT model compile a LoRA plan "
                             "(compile-plan --lora, docs/lora.md) or sync with TRL's own path")
        s, rank = self.weightplan, self.accelerator.process_index
        if self.mode == "colocate":
            tp = self.tensor_parallel_size
            replicas = [(replica_job(s.job, j), LLMClient(self.llm) if rank // tp == j else None)
                        for j in range(self.accelerator.num_processes // tp)]
        else:
            replicas = [(s.job, HTTPVLLMWeightSyncClient(self.vllm_client.base_url) if rank == 0 else None)]
        engines, device = [], self.accelerator.device
        shared = {"plan": s.plan or self._compile_plan(), "address": s.address} if rank == 0 else {}
        for j, (job, client) in enumerate(replicas):
            if j == 0 and rank != 0:
                shared = broadcast_json({}, device)  # the plan, and the store rank 0 serves by now
            self.plan_path = shared["plan"]
            info = trainer_init_info(s, rank=rank, plan=self.plan_path, address=shared["address"], job=job,
                                     serve_store=rank == 0 and j == 0, drives=client is not None)
            engines.append(start_engine(info, self.model, client))
            if j == 0 and rank == 0:
                shared["address"] = info.address
                broadcast_json(shared, device)
        return engines

    def _compile_plan(self) -> str:
        """Trainer rank 0: the live model's layout, compiled against this run's engine layout (adapters/live_plan.py)."""
        # Colocated replicas are independent engines, each reading the same plan in its own job.
        tp = self.tensor_parallel_size if self.mode == "colocate" else self.vllm_client.get_world_size()
        return compile_live_plan(self.model, str(self.model.name_or_path), f"tp={tp}", self.weightplan.workdir,
                                 "trl.plan")

    def close(self) -> None:
        for engine in self.trainer_engines or ():
            engine.shutdown()
        self.trainer_engines = None


class WeightplanGRPOTrainer(grpo_trainer.GRPOTrainer):
    """TRL's GRPOTrainer syncing through weightplan: `weightplan=WeightplanSettings(...)` is its one extra argument."""

    def __init__(self, *args, weightplan: WeightplanSettings | None = None, **kwargs) -> None:
        def generation(*a, **kw):
            return WeightplanVLLMGeneration(*a, weightplan=weightplan, **kw)

        # GRPOTrainer builds its VLLMGeneration by this module-global name inside __init__; no hook takes a class.
        with _swapped(grpo_trainer, "VLLMGeneration", generation):
            super().__init__(*args, **kwargs)


@contextlib.contextmanager
def _swapped(module, name: str, value):
    with _SWAP:
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, saved)


def _llm_factory(llm_cls, extra: dict[str, Any]):
    """`vllm.LLM` with the weightplan backend and `extra` over TRL's arguments."""
    from vllm.config import WeightTransferConfig

    def build(*args, **kwargs):
        return llm_cls(*args, **{**kwargs, "weight_transfer_config": WeightTransferConfig(backend="weightplan"), **extra})

    return build
