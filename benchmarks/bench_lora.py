"""Benchmark: a LoRA adapter update of a live vLLM CPU engine through the weightplan backend, against a PEFT reload.

Usage: python benchmarks/bench_lora.py [--updates N] [--rank R] [--smoke]   (make bench-lora)

One `vllm.LLM` CPU engine (tp=1, dummy base weights, `enable_lora=True, max_loras=3`) with the weightplan backend and
a LoRA plan (`compile-plan --lora R`); this process is the trainer (fsdp=1, PEFT-named bf16 tensors). Per version:
  (a)  update_s: `send_weights(v)` (publish, start/update/finish on the engine, release): the adapter lands over NIXL
       in a free LoRA slot and is served under adapter id v (docs/lora.md);
  (b)  baseline_s: what a framework does without a transfer engine: save the same adapter as a PEFT directory
       (adapter_config.json + adapter_model.safetensors) and load it into the engine under a new adapter id
       (`llm.llm_engine.add_lora`, vLLM's own load from disk: read, pack, activate into the third slot);
  identical: under both ids the engine generates the same greedy tokens, for every version.
Medians over the updates after the first (and the fastest of each: `*_min_s`, `speedup_min`). adapter_bytes: the adapter's bytes on the wire (the plan's source bytes).
update_breakdown (medians, seconds): the trainer's publish (and its CPU time) and release; the three engine calls start/update/finish
(`*_rpc_s`, from this process); inside the update call the worker's own time (`worker_update_s`: freeing the slot,
waiting for the trainer's version record, connecting, the READs, routing the id) and vLLM's RPC path to and from it
(`update_rpc_in_s`/`update_rpc_out_s`, wall clocks of one host); `restore_s`: re-routing after vLLM's LoRA reset.
Full size: benchmarks/configs/bench-llama (a dense Llama of 0.49 B parameters, 1 GB in bf16; a MoE engine with
enable_lora dies on CPU: its fused MoE takes vLLM's Triton path), rank 16, 16 updates. --smoke:
tests/configs/engine-llama, rank 8, 2 updates (tests/e2e/test_benchmark_smoke.py checks it runs, not its figures).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

PROMPT = [5, 9, 17, 33]


def _greedy(llm, request) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=8, temperature=0.0),
                       lora_request=request, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _adapter(plan, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g).to(getattr(torch, s.dtype)) for s in plan.sources}


class _Timed:
    """Wraps an object's methods: each call's wall time is kept, by method name (the last call's)."""

    def __init__(self, target, names: tuple[str, ...]) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}  # CPU time of the calling thread: wall - CPU is waiting or descheduled
        self.called_at: dict[str, float] = {}  # wall clock, to compare with the engine worker's (same host)
        self.returned_at: dict[str, float] = {}
        for name in names:
            setattr(target, name, self._timed(name, getattr(target, name)))

    def _timed(self, name: str, method):
        def call(*args, **kwargs):
            began, cpu = time.perf_counter(), time.thread_time()
            self.called_at[name] = time.time()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] = time.perf_counter() - began
                self.cpu_seconds[name] = time.thread_time() - cpu
                self.returned_at[name] = time.time()

        return call


def _breakdown(total: float, calls: dict[str, float], release_s: float, worker: dict, rpcs: _Timed,
               publish_cpu_s: float) -> dict[str, float]:
    """Where one update's `update_s` went (seconds): the trainer's publish and release, the three engine calls
    (vLLM's RPC around the worker's own work), and inside the update call the worker's phases (vllm_backend/lora_update.py)."""
    phases = worker["breakdown"]
    inside = worker["transfer_s"]
    return {"publish_s": calls["publish"], "publish_cpu_s": publish_cpu_s, "start_rpc_s": calls["start_weight_update"],
            "update_rpc_s": calls["update_weights"], "finish_rpc_s": calls["finish_weight_update"],
            "release_s": release_s, "worker_update_s": inside,
            "update_rpc_in_s": worker["began_at"] - rpcs.called_at["update_weights"],
            "update_rpc_out_s": rpcs.returned_at["update_weights"] - worker["ended_at"],
            "restore_s": worker["restore_s"] or 0.0,
            **phases, "other_s": total - calls["publish"] - max(release_s, sum(calls[k] for k in _RPCS))}


_RPCS = ("start_weight_update", "update_weights", "finish_weight_update")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, help="adapter versions (default 16; 2 with --smoke)")
    parser.add_argument("--rank", type=int, help="adapter rank (default 16; 8 with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, rank 8, 2 updates: checks it runs")
    args = parser.parse_args()
    updates = args.updates or (2 if args.smoke else 16)
    rank = args.rank or (8 if args.smoke else 16)
    model = ROOT / ("tests/configs/engine-llama" if args.smoke else "benchmarks/configs/bench-llama")

    import torch
    from vllm.lora.request import LoRARequest

    from weightplan.testing.engines import backend_info, local_shards, make_llm, pin_no_amx, shutdown
    from weightplan.compiler.compile import CompileOptions, compile_plan
    from weightplan.compiler.verify_lora import spec_of, write_peft_dir
    from weightplan.runtime import load_plan
    from weightplan.vllm_backend.clients import LLMClient
    from weightplan.vllm_backend.trainer import ShardSource, WeightplanTrainerEngine, WeightplanTrainerInitInfo

    # This process is the trainer and the baseline's saver. One torch thread: on this host's 2 cores, shared with the
    # engine and other jobs, a second OpenMP thread made each small op wait for it to be scheduled (the trainer's
    # publish took 0.3-2.8 s instead of 2 ms at load average 18). The engine processes keep vLLM's own settings.
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    unpin = pin_no_amx(tmp)
    plan_path = tmp / "lora.plan"
    compile_plan(CompileOptions(str(model), output=plan_path, lora=f"{rank},alpha={2 * rank},max_rank={rank}"))
    plan = load_plan(plan_path)
    spec, targets = spec_of(plan)
    adapter_bytes = sum(s.nbytes for s in plan.sources)
    unread = tmp / "never-read"
    unread.mkdir()
    llm, trainer, rows = None, None, []
    try:
        llm = make_llm(model, dummy=True, backend=True, enable_lora=True, max_loras=3, max_lora_rank=rank)
        first = _adapter(plan, 1)
        tensors = {name: t.clone() for name, t in local_shards(plan, first, 0).items()}
        info = WeightplanTrainerInitInfo(rank=0, plan=str(plan_path), address="127.0.0.1:0", job="bench-lora", timeout=120)
        client = LLMClient(llm)
        rpcs = _Timed(client, _RPCS)
        trainer = WeightplanTrainerEngine.trainer_init(info, client=client, source=ShardSource(tensors))
        publish = _Timed(trainer.sender, ("publish",))
        for v in range(1, updates + 1):
            full = first if v == 1 else _adapter(plan, v)
            for name, value in local_shards(plan, full, 0).items():
                tensors[name].copy_(value)
            began = time.perf_counter()
            trainer.send_weights(v)
            update_s = time.perf_counter() - began
            ours = _greedy(llm, LoRARequest(f"v{v}", v, str(unread)))
            worker = llm.collective_rpc(backend_info)[0]  # after a generate: the restore after vLLM's reset ran
            breakdown = _breakdown(update_s, {**rpcs.seconds, **publish.seconds}, trainer.last_release.seconds, worker, rpcs,
                                   publish.cpu_seconds["publish"])
            began = time.perf_counter()
            peft = write_peft_dir(tmp / f"peft{v}", spec, targets, full)
            request = LoRARequest(f"peft{v}", 1000 + v, str(peft))
            llm.llm_engine.add_lora(request)
            baseline_s = time.perf_counter() - began
            theirs = _greedy(llm, request)
            llm.llm_engine.remove_lora(1000 + v)
            rows.append({"version": v, "update_s": round(update_s, 4), "baseline_s": round(baseline_s, 4),
                         "identical": ours == theirs, "breakdown": breakdown})
            print(f"version {v}: update {update_s:.3f} s, PEFT save + load {baseline_s:.3f} s, identical {ours == theirs}; "
                  + ", ".join(f"{k} {1e3 * x:.1f} ms" for k, x in breakdown.items()), flush=True)
    finally:
        if trainer is not None:
            trainer.shutdown()
        if llm is not None:
            shutdown(llm)
        unpin()
    timed = rows[1:] or rows
    update_s = statistics.median(r["update_s"] for r in timed)
    baseline_s = statistics.median(r["baseline_s"] for r in timed)
    breakdown = {k: round(statistics.median(r["breakdown"][k] for r in timed), 4) for k in timed[0]["breakdown"]}
    # The fastest update and baseline: each without interference from other jobs on the host, as near as one run gets.
    fastest = min(r["update_s"] for r in timed), min(r["baseline_s"] for r in timed)
    print(json.dumps({"update_s": update_s, "baseline_s": baseline_s, "speedup": round(baseline_s / update_s, 2),
                      "update_min_s": fastest[0], "baseline_min_s": fastest[1],
                      "speedup_min": round(fastest[1] / fastest[0], 2),
                      "adapter_bytes": adapter_bytes, "identical": all(r["identical"] for r in rows),
                      "rank": rank, "model": model.name, "updates": updates, "update_breakdown": breakdown}))


if __name__ == "__main__":
    main()
