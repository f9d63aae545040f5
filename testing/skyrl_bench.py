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


def initial_weights() -> dict[str, torch.Tensor]:
    """The policy's weights before its first step: transformers' model of CONFIG built as fsdp2_llama builds it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIG), dtype=torch.float32)
    return {name: t.detach() for name, t in model.state_dict().items()}


ALIGN = 64  # byte alignment of each tensor in the handover buffer


def receive_in_memory(worker, buffer: str, layout: list[tuple[str, str, list[int], int]]) -> None:
    """The receive step of vLLM 0.30's NCCL weight-transfer engine (NCCLWeightTransferEngine.receive_weights, packed, as
    SkyRL configures it) with the broadcast replaced by an in-memory handover: the packed buffer is the shared-memory
    block `buffer` the trainer side filled, unpacked into (name, tensor) views as packed_nccl_broadcast_consumer unpacks
    its buffer, and handed to the engine's `model.load_weights` inside the layerwise reload its start_weight_update
    began. `llm.collective_rpc(receive_in_memory, args=(buffer, layout))` between start_ and finish_weight_update."""
    from multiprocessing import shared_memory

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    if not worker._weight_update_active:
        raise RuntimeError("start_weight_update must be called before the weights are handed over")
    blocks = worker.__dict__.setdefault("_skyrl_bench_buffers", {})
    if buffer not in blocks:  # attached once, as NCCL's packed buffers are reused
        # (the engine's processes share the trainer process's resource tracker, which the trainer side's unlink
        # clears: the block is the trainer side's)
        blocks[buffer] = shared_memory.SharedMemory(name=buffer)
    raw = torch.frombuffer(blocks[buffer].buf, dtype=torch.uint8)
    named = []
    for name, dtype_name, shape, offset in layout:
        dtype = getattr(torch, dtype_name)
        size = torch.Size(shape).numel() * dtype.itemsize
        named.append((name, raw[offset:offset + size].view(dtype).view(shape)))
    engine = worker.weight_transfer_engine
    with set_current_vllm_config(worker.vllm_config), disable_mtp_completeness_check():
        # packed_nccl_broadcast_consumer hands each unpacked buffer to post_unpack_func=self.model.load_weights; the
        # whole 0.6 MB model fits SkyRL's one packed buffer (at least 1 GiB), so one call
        engine.model.load_weights(named)
    # (the base update_weights then calls torch.accelerator.synchronize(): nothing is asynchronous here)


def nccl_llm(model: Path):
    """An engine as make_llm(model, dummy=False, backend=False) starts it, on vLLM's own `nccl` weight-transfer
    backend (what SkyRL's servers run for its default weight_sync_backend)."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from weightplan.testing.engines import KV_CACHE_BYTES, engine_env

    engine_env()
    return LLM(model=str(model), load_format="safetensors", skip_tokenizer_init=True, enforce_eager=True,
               dtype="bfloat16", kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=128, max_num_seqs=4, seed=0,
               weight_transfer_config=WeightTransferConfig(backend="nccl"))


def _kernel_digests(worker) -> dict[str, str]:
    from weightplan.testing.engines import kernel_digests

    return kernel_digests(worker)


class SkyrlDefaultPath:
    """SkyRL's default (`nccl`) path as far as it runs on a CPU, into a live vLLM engine of its own (vLLM's `nccl`
    weight-transfer backend): per sync, the engine's `start_weight_update` (vLLM's initialize_layerwise_reload), SkyRL's
    `FsdpWeightSource` iterated (every parameter `full_tensor()`ed and cast to the model dtype, what SkyRL's NCCL sender
    broadcasts) into one packed buffer, that buffer handed to the engine's worker in memory and loaded there as vLLM's
    NCCL receive engine loads what it receives (receive_in_memory), then `finish_weight_update`
    (finalize_layerwise_reload: the engine's packed layers rebuilt) with the step as weight version. Only the NCCL
    broadcast itself (CUDA) is replaced: by a shared-memory block the trainer side fills and one engine RPC naming it.
    vLLM's NCCL trainer engine overlaps its update_weights RPC with the broadcast; here the handover follows the
    iteration (on this 0.6 MB model the difference is the RPC's latency at most)."""

    def __init__(self, llm, policy: torch.nn.Module):
        from multiprocessing import shared_memory

        from skyrl.backends.skyrl_train.weight_sync.sources import FsdpWeightSource

        self.llm = llm
        self.source = FsdpWeightSource(policy, torch.bfloat16, "")
        size = sum(-(-meta.dtype.itemsize * torch.Size(meta.shape).numel() // ALIGN) * ALIGN
                   for meta in self.source.metadata())
        # the handover buffer, allocated once as SkyRL's packed NCCL buffer is
        self.block = shared_memory.SharedMemory(create=True, size=max(size, 1))
        self.raw = torch.frombuffer(self.block.buf, dtype=torch.uint8)

    def sync(self, version: int) -> float:
        """One sync's seconds, from its first call (start_weight_update, before the trainer iterates, as vLLM's NCCL
        trainer engine orders it) until the engine holds `version`."""
        start = time.perf_counter()
        self.llm.start_weight_update()
        layout, offset = [], 0
        for name, tensor in self.source:  # what the NCCL sender packs and broadcasts
            size = tensor.numel() * tensor.element_size()
            self.raw[offset:offset + size].copy_(tensor.contiguous().view(-1).view(torch.uint8))
            layout.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset))
            offset += -(-size // ALIGN) * ALIGN
        self.llm.collective_rpc(receive_in_memory, args=(self.block.name, layout))
        self.llm.finish_weight_update(weight_version=str(version))
        return time.perf_counter() - start

    def close(self) -> None:
        del self.raw
        self.block.unlink()
        try:
            self.block.close()
        except BufferError:  # a tensor view still exports the mapping: the process exit frees it
            pass

    def digests(self) -> dict[str, str]:
        """SHA-256 of every tensor the engine's modules hold (packed `cpu_linear` weights included)."""
        return self.llm.collective_rpc(_kernel_digests)[0]


def run_skyrl(steps: int, workdir: Path) -> dict:
    """`steps` AdamW steps of an FSDP2 policy, each followed by SkyRL's `send_weights()` through weightplan into a live
    vLLM engine and by SkyRL's default path into another (SkyrlDefaultPath), both engines started from the policy's
    initial weights. Returns each path's seconds per step, whether every step the weightplan engine held exactly vLLM's
    own load of the gathered state, and whether the default path's engine then held the same kernel tensors (and they
    changed). One line per step on stdout; the plan and the layout go in `workdir`/weightplan."""
    from skyrl.backends.skyrl_train.weight_sync import weight_senders
    from skyrl.backends.skyrl_train.weight_sync.sources import FsdpWeightSource
    from skyrl.train.config.config import InferenceEngineConfig
    from torch.distributed.tensor import DTensor

    from weightplan.adapters import skyrl as adapter
    from weightplan.runtime import load_plan
    from weightplan.testing.engines import (kernel_digests_differ, make_llm, pin_no_amx, shutdown, staged_digests,
                                           write_checkpoint)
    from weightplan.testing.rl_inference import FreshLoad
    from weightplan.vllm_backend.clients import LLMClient

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with functions: the check and
    # the baseline's in-memory handover
    unpin = pin_no_amx(workdir)
    engines, engine, default_path, sky_client = [], None, None, weight_senders.SkyrlWeightSyncClient
    try:
        start_from = write_checkpoint(CONFIG, initial_weights(), workdir / "initial")
        llm = make_llm(start_from, dummy=False, backend=True)
        engines.append(llm)
        # the default path's engine: vLLM's own nccl backend, as SkyRL's servers run for weight_sync_backend="nccl"
        theirs_llm = nccl_llm(start_from)
        engines.append(theirs_llm)
        judge = FreshLoad(CONFIG)  # vLLM's own load_weights of the gathered state (it makes the one-rank world)
        policy = fsdp2_llama(str(CONFIG))
        optimizer = torch.optim.AdamW(policy.parameters(), lr=0.05)
        default_path = SkyrlDefaultPath(theirs_llm, policy)
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
        previous = default_path.digests()  # the default path's engine before the first step
        for step in range(1, steps + 1):
            train_step(policy, optimizer)
            start = time.perf_counter()
            engine.send_weights()  # what SkyRL's Worker._sync_weights_to_inference_engines calls
            ours.append(time.perf_counter() - start)
            theirs.append(default_path.sync(step))
            full = {name: DTensor.full_tensor(t).detach() for name, t in policy.state_dict().items()}
            expected, staged = judge.digests(full, plan), llm.collective_rpc(staged_digests)[0]
            differ = sorted(k for k in staged if expected.get(k) != staged[k])
            identical &= bool(staged) and not differ and engine.version == step
            ours_kernels, theirs_kernels = llm.collective_rpc(_kernel_digests)[0], default_path.digests()
            baseline_differ = kernel_digests_differ(ours_kernels, theirs_kernels)
            changed = theirs_kernels != previous
            baseline_identical &= bool(theirs_kernels) and not baseline_differ and changed
            previous = theirs_kernels
            print(json.dumps({"event": "step", "step": step, "update_s": round(ours[-1], 4),
                              "baseline_s": round(theirs[-1], 4), "digests": len(staged), "digests_differ": differ[:5],
                              "kernel_tensors": len(theirs_kernels), "baseline_digests_differ": baseline_differ[:5],
                              "baseline_changed": changed}), flush=True)
        return {"ours": ours, "theirs": theirs, "identical": identical, "baseline_identical": baseline_identical,
                "init_s": init_s, "parameters": sum(p.numel() for p in policy.parameters())}
    finally:
        weight_senders.SkyrlWeightSyncClient = sky_client
        if engine is not None:
            weight_senders.teardown_engine(engine)
        adapter.uninstall()
        for each in engines:
            shutdown(each)
        if default_path is not None:
            default_path.close()
        unpin()
