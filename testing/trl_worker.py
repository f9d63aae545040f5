"""One trainer rank of a TRL run synced by weightplan: FSDP2 (dp_shard, ep) DeepSeek-V3 trainer, TRL's VLLMGeneration.

    python -m weightplan.testing.trl_worker --rank R --world 4 --address HOST:PORT --workdir DIR [--mode colocate|server]
    run_trainers(workdir, *options)   # all 4 ranks, from a test or benchmark

Each step: one optimizer step on examples/moe_trainer.py's toy objective; rank 0 saves an HF checkpoint of the gathered
state (the check's ground truth, not the sync); `sync_weights()` (TRL's entry point); then, colocate mode, every rank
writes its engine's greedy output and rank 0 the digests of the weights its engine rebuilt its kernels from next to
vLLM's own load of that state (`step-S-rank-R.json`). `--baseline`: the same steps synced by TRL's own colocate path as
far as it runs on CPU (`TRLGather`), timed. JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from weightplan.testing import moe_trainer as mt
from weightplan.testing.rl_inference import FreshLoad, hf_model
from weightplan.compiler.frontend.trainer_formats import load_trainer_model
from weightplan.testing.engines import KV_CACHE_BYTES, ROOT, free_port, greedy
from weightplan.testing.engines import staged_digests as engine_staged_digests

WORLD = 4  # trainer ranks: a (dp_shard=2, ep=2) mesh

ENGINE = dict(load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=128, seed=0)


def staged_digests(llm) -> dict[str, str]:
    """engines.staged_digests of an in-process engine's worker."""
    return engine_staged_digests(llm.llm_engine.model_executor.driver_worker.worker)


def run_trainers(workdir: Path, *options: str, timeout: float = 600) -> list[str]:
    """The WORLD trainer ranks of this module to completion (one failing fails the call, with its stderr); their stdout."""
    from weightplan.runtime import Rendezvous

    store = Rendezvous.connect("trl-trainers", "127.0.0.1:0", serve=True, timeout=60)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "weightplan.testing.trl_worker", "--rank", str(r), "--world", str(WORLD),
                               "--address", store.address, "--master-port", str(port), "--workdir", str(workdir), *options],
                              cwd=ROOT, stdout=open(workdir / f"rank{r}.out", "w"), stderr=open(workdir / f"rank{r}.err", "w"))
             for r in range(WORLD)]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise AssertionError((workdir / f"rank{(failed or [0])[0]}.err").read_text()[-4000:])
            time.sleep(0.5)
        if any(p.returncode != 0 for p in procs):
            raise AssertionError((workdir / "rank0.err").read_text()[-4000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(workdir / f"rank{r}.out").read_text() for r in range(WORLD)]


class TRLGather:
    """TRL's own FSDP2 sync where it runs on CPU: its `VLLMGeneration._iter_named_params` (every rank `full_tensor()`s
    every parameter) into vLLM's `load_weights` of a loader-built model on every rank. TRL hands those tensors to its
    colocated engine's model; a live CPU engine has packed its linears and refuses them ("'Parameter' object has no
    attribute 'weight_loader'"), so the loader-built model stands in for it; and TRL names them as transformers 5
    holds them (stacked experts, which vLLM's DeepSeek loader refuses: KeyError 'layers.1.mlp.experts.gate_up_proj'),
    so transformers' own `revert_weight_conversion` renames them to checkpoint names first."""

    def __init__(self, model, accelerator, args) -> None:
        from trl.distributed import DistributedBackend
        from trl.generation.vllm_generation import VLLMGeneration
        from vllm.distributed import init_distributed_environment

        self.trl = VLLMGeneration.__new__(VLLMGeneration)  # TRL's iteration methods, without starting its engine
        self.trl.model, self.trl.accelerator, self.trl._dist = model, accelerator, DistributedBackend(accelerator)
        self.trl._dist.fsdp_version = 2  # what accelerate's FSDP2 plugin makes TRL detect; the model is FSDP2 here
        # vLLM's world group over the trainers' group, as a colocated engine sets it up; then a vLLM model per rank
        init_distributed_environment(world_size=args.world, rank=args.rank, local_rank=args.rank, backend="gloo")
        self.fresh = FreshLoad(mt.ENGINE_CONFIG)
        self.names = load_trainer_model(mt.ENGINE_CONFIG, torch.float32).model  # meta, with its weight conversions

    def sync_weights(self) -> None:
        from transformers.core_model_loading import revert_weight_conversion

        from weightplan.compiler.frontend.vllm_patches import parallel_rank

        gathered = dict(self.trl._iter_named_params())
        with torch.no_grad(), parallel_rank(self.fresh.vllm_config, 0, 0):
            self.fresh.reference.load_weights(revert_weight_conversion(self.names, gathered).items())

    def close(self) -> None:
        pass


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
    p.add_argument("--world", type=int, default=WORLD)
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
    generation = TRLGather(model, accelerator, args) if args.baseline else \
        WeightplanVLLMGeneration(**kwargs, weightplan=settings)
    print(json.dumps({"event": "ready", "rank": args.rank, "start_s": round(time.perf_counter() - began, 1)}), flush=True)
    fresh = FreshLoad(mt.ENGINE_CONFIG) if args.check and args.rank == 0 and args.mode == "colocate" else None
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
            if fresh is not None:
                expected = fresh.digests(torch.load(checkpoint / "full.pt", weights_only=True), load_plan(generation.plan_path))
                actual = staged_digests(generation.llm)
                out["digests"] = len(actual)
                out["digests_differ"] = sorted(k for k in actual if expected.get(k) != actual[k])
            (args.workdir / f"step-{step}-rank-{args.rank}.json").write_text(json.dumps(out))
        print(json.dumps(line), flush=True)
        torch.distributed.barrier()
    generation.close()
    print(json.dumps({"event": "done", "rank": args.rank}), flush=True)


if __name__ == "__main__":
    main()
