"""One trainer rank of a TRL run synced by weightplan: FSDP2 (dp_shard, ep) DeepSeek-V3 trainer, TRL's VLLMGeneration.

    python -m tests.support.trl_worker --rank R --world 4 --address HOST:PORT --workdir DIR [--mode colocate|server]

Each step: one optimizer step on examples/moe_trainer.py's toy objective; rank 0 saves an HF checkpoint of the gathered
state (the check's ground truth, not the sync); `sync_weights()` (TRL's entry point); then, colocate mode, every rank
writes its engine's greedy output and rank 0 the digests of the weights its engine rebuilt its kernels from next to
vLLM's own load of that state (`step-S-rank-R.json`). `--baseline`: the same steps synced by TRL's own colocate path
(`full_tensor()` + `load_weights`, the CPU-runnable part of TRL's sync), timed. JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from examples import moe_trainer as mt
from examples.rl_inference import FreshLoad, hf_model
from tests.support.vllm_engine_support import KV_CACHE_BYTES, greedy

ENGINE = dict(load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=128, seed=0)


def staged_digests(llm) -> dict[str, str]:
    """SHA-256 (as vLLM's compute_tensor_digests) of the staged loader-layout tensors the engine rebuilt its kernels from."""
    destination = llm.llm_engine.model_executor.driver_worker.worker.weight_transfer_engine.destination
    return {name: hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for name, t in destination.tensors.items()}


def save_checkpoint(model, out: Path, rank: int) -> None:
    """The gathered full state dict (a collective), saved by rank 0 with transformers' save_pretrained (checkpoint names)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        reference = hf_model(mt.ENGINE_CONFIG)
        reference.load_state_dict({k: v.to(torch.bfloat16) for k, v in full.items()})
        reference.save_pretrained(str(out))
        torch.save(full, out / "full.pt")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--address", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--mode", choices=("colocate", "server"), default="colocate")
    p.add_argument("--server", help="server mode: the vLLM server's base URL")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--check", action="store_true", help="checkpoints, greedy outputs and digests every step")
    p.add_argument("--baseline", action="store_true", help="sync with TRL's own colocate path instead")
    args = p.parse_args(argv)
    os.environ.update(RANK=str(args.rank), LOCAL_RANK=str(args.rank), WORLD_SIZE=str(args.world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.master_port))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from accelerate import Accelerator

    from weightplan.adapters.trl import WeightplanSettings, WeightplanVLLMGeneration
    from weightplan.runtime import Rendezvous, load_plan

    rendezvous = Rendezvous.connect("trl-trainers", args.address, timeout=120)
    mt.init_trainer_group(args.rank, args.world, rendezvous)
    accelerator = Accelerator(cpu=True)
    model = mt.build_model(mt.ENGINE_CONFIG)
    model.name_or_path = str(mt.ENGINE_CONFIG)
    mt.parallelize(model, ep=args.ep, param_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    settings = WeightplanSettings(job="trl-test", workdir=str(args.workdir), llm_kwargs=ENGINE, timeout=120)
    began = time.perf_counter()
    kwargs = dict(model=model, accelerator=accelerator, processing_class=None, mode=args.mode, max_num_seqs=4,
                  server_base_url=args.server, server_timeout=300)
    if args.baseline:
        from trl.generation import vllm_generation

        from weightplan.adapters.trl import _llm_factory, _swapped

        with _swapped(vllm_generation, "LLM", _llm_factory(vllm_generation.LLM, {**ENGINE, "weight_transfer_config": None})):
            generation = vllm_generation.VLLMGeneration(**kwargs)
        generation._dist.fsdp_version = 2  # what accelerate's FSDP2 plugin makes TRL detect; the model is sharded here
    else:
        generation = WeightplanVLLMGeneration(**kwargs, weightplan=settings)
    print(json.dumps({"event": "ready", "rank": args.rank, "start_s": round(time.perf_counter() - began, 1)}), flush=True)
    fresh = FreshLoad(mt.ENGINE_CONFIG) if args.check and args.rank == 0 and args.mode == "colocate" and not args.baseline else None
    for step in range(1, args.steps + 1):
        loss = mt.train_steps(model, optimizer, 1)
        checkpoint = args.workdir / f"checkpoint-{step}"
        if args.check:
            save_checkpoint(model, checkpoint, args.rank)
        torch.distributed.barrier()
        began = time.perf_counter()
        generation.sync_weights()
        seconds = time.perf_counter() - began
        line = {"event": "step", "step": step, "rank": args.rank, "loss": loss, "update_s": round(seconds, 4)}
        if args.check and args.mode == "colocate":
            out = {"greedy": greedy(generation.llm)}
            if fresh is not None and not args.baseline:
                expected = fresh.digests(torch.load(checkpoint / "full.pt", weights_only=True), load_plan(generation.plan_path))
                actual = staged_digests(generation.llm)
                out["digests"] = len(actual)
                out["digests_differ"] = sorted(k for k in actual if expected.get(k) != actual[k])
            (args.workdir / f"step-{step}-rank-{args.rank}.json").write_text(json.dumps(out))
        print(json.dumps(line), flush=True)
        torch.distributed.barrier()
    if not args.baseline:
        generation.close()
    print(json.dumps({"event": "done", "rank": args.rank}), flush=True)


if __name__ == "__main__":
    main()
