"""Benchmark: a live FSDP2 trainer's weights to servable inference weights, against gather-full-state-dict + load_weights.

Usage: python benchmarks/bench_trainer.py [--steps N] [--masters fp32|bf16] [--smoke]   (make bench-trainer)

One run, one machine: this process is the inference side and starts `--trainers` (4) trainer
processes (this file with `--role trainer`). The trainers build transformers'
DeepseekV3ForCausalLM for benchmarks/configs/bench-deepseek-v3 (MLA, kv_lora 512; 1.03 GB of bf16
weights, 2.06 GB of fp32 masters) and shard it with FSDP2 over gloo on CPU as
testing/moe_trainer.py does (experts Shard(0) over ep on a (dp_shard, ep) = (2, 2) mesh), with fp32
masters and MixedPrecisionPolicy(param_dtype=bf16) by default (bf16 on the wire), plain SGD (no
optimizer state, to fit this host's memory; the figures start after optimizer.step()). The
inference side builds two vLLM models as vLLM's loader builds them (bf16, CPU): one a `Receiver`
writes into, one for the baseline.

Per measured step, two optimizer steps (one per path, so each path starts right after a step):
  (ours)     optimizer.step(); every trainer `LiveSender.publish(v)` (casts its fp32 shards to bf16 in
             its staging region) then `release(v)`; the inference side `Receiver.sync(v)` (one-sided
             NIXL READs, sequence checks, then MLA's derived post-load tensors).
             publish_s: the slowest trainer's publish. sync_s: the sync alone, from every version
             announced to sync returned. end_to_end_s: from the end of optimizer.step() on the slowest
             trainer to the sync returned (wall clock, one host).
  (baseline) optimizer.step(); every trainer calls get_model_state_dict(model,
             StateDictOptions(full_state_dict=True, cpu_offload=True)) (all-gathers every DTensor;
             rank 0 keeps the full fp32 dict); rank 0 casts it to bf16 into one preallocated flat
             buffer (the plan's tensor order) and sends it with one gloo broadcast over a 2-member
             group (trainer 0, inference process; loopback TCP); the inference side cuts the buffer
             into the trainer's tensors, converts them to checkpoint names and shapes with
             transformers' revert_weight_conversion (the plan's trainer format, `stacked`), runs vLLM's
             `model.load_weights` and then MLA's process_weights_after_loading (the derived state).
             baseline_s: from the end of optimizer.step() on the slowest trainer to that done.
Version 1 (the initial weights) warms both paths up (connections, gloo pairs) and is not timed.
A last untimed version after the final baseline step (no optimizer step in between) checks that the
synced vLLM model's digests equal the baseline-loaded model's (`identical`).

Figures are medians over the steps. staging_bytes: the largest trainer's `Sender.staging_bytes`
(extra memory the publish writes into), against that trainer's own shards in bf16
(`shard_bf16_bytes`) and as it holds them (`shard_bytes`, fp32 masters). --smoke: testing/configs/tiny-deepseek-v3,
2 trainers, ep 1, one measured step; it checks that everything runs, not the figures (tests/e2e/test_benchmark_smoke.py).
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

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from weightplan.testing import moe_trainer as mt  # noqa: E402
from weightplan.testing.moe_trainer import DTYPES, TrainerProcesses, add_trainer_options  # noqa: E402
from runtime_bench_worker import _broadcast, _gloo  # noqa: E402  (standalone gloo groups on the job's store)
from weightplan.runtime import LiveSender, Receiver, Rendezvous, load_plan, write_trainer_layout  # noqa: E402
from weightplan.runtime.transport import protocol  # noqa: E402

CONFIG = ROOT / "benchmarks" / "configs" / "bench-deepseek-v3"
SMOKE = ["--config", str(mt.CONFIG), "--trainers", "2", "--ep", "1", "--steps", "1"]  # what --smoke stands for


# ---------------------------------------------------------------------------------------------- trainer


def run_trainer(args) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from weightplan.runtime.layout.module_tensors import trainer_tensors

    rendezvous = Rendezvous.connect(args.job, args.address, timeout=args.timeout)
    mt.init_trainer_group(args.rank, args.trainers, rendezvous)
    model = mt.build_model(args.config, DTYPES[args.masters])
    mt.parallelize(model, ep=args.ep, param_dtype=torch.bfloat16 if args.masters == "fp32" else None)
    # SGD keeps no state: AdamW's two fp32 moments (4 GB over the 4 trainers) do not fit next to everything else
    # on this 23 GB host. Every figure starts at the end of optimizer.step(), so the optimizer does not enter them.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if args.rank == 0:
        write_trainer_layout(model, Path(args.workdir) / "trainer-layout.json")
        rendezvous.put("bench/layout", b"1")
    rendezvous.wait(["bench/plan"], args.timeout * 4, "the plan from the inference side")
    plan = load_plan(rendezvous.get_bytes("bench/plan").decode())
    bcast = _gloo(rendezvous, "baseline", 0, 2) if args.rank == 0 else None
    sender = LiveSender(plan, args.rank, model, rendezvous=rendezvous, timeout=args.timeout).start()
    shards = [getattr(t, "to_local", lambda t=t: t)() for t in trainer_tensors(model).values()]
    rendezvous.put(f"bench/info/{args.rank}", {
        "staging_bytes": sender.staging_bytes, "shard_bytes": sum(t.numel() * t.element_size() for t in shards),
        "shard_bf16_bytes": sum(t.numel() * 2 for t in shards),
        "staged_region_bytes": sum(r.nbytes for r in sender.regions if r.staged), "packing_bytes": sender.packing.nbytes,
        "regions": len(sender.regions)})
    flat = None
    if args.rank == 0:
        flat = torch.empty(sum(e.numel for e in plan.sources), dtype=torch.bfloat16)

    def baseline(key: str, step_end: float) -> None:
        began = time.perf_counter()
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        gathered = time.perf_counter()
        if args.rank == 0:
            offset = 0
            with torch.no_grad():
                for entry in plan.sources:
                    flat[offset:offset + entry.numel].copy_(full[entry.name].reshape(-1))
                    offset += entry.numel
            del full
            _broadcast(bcast, flat, 0)
        else:
            del full
        rendezvous.put(f"{key}/{args.rank}", {"step_end": step_end, "gather_s": gathered - began,
                                              "send_s": time.perf_counter() - gathered})

    # version 1: the initial weights, through both paths, untimed (connections, gloo pairs)
    sender.publish(1)
    sender.release(1)
    baseline("bench/base/0", time.time())
    for step in range(1, args.steps + 1):
        mt.train_steps(model, optimizer, 1)
        step_end = time.time()
        began = time.perf_counter()
        sender.publish(step + 1)
        publish_s = time.perf_counter() - began
        rendezvous.put(f"bench/ours/{step}/{args.rank}", {"step_end": step_end, "publish_s": publish_s})
        sender.release(step + 1)
        mt.train_steps(model, optimizer, 1)
        baseline(f"bench/base/{step}", time.time())
    sender.publish(args.steps + 2)  # the baseline's last weights, for the identity check
    sender.release(args.steps + 2)
    sender.close()


# ---------------------------------------------------------------------------------------------- inference


def run_inference(args) -> int:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    from weightplan.compiler.compile import CompileOptions, compile_plan
    from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config
    from weightplan.compiler.frontend.vllm_patches import parallel_rank
    from weightplan.compiler.verify_plan import plan_conversion

    began = time.perf_counter()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="weightplan-bench-trainer-"))
    workdir.mkdir(parents=True, exist_ok=True)
    trainers = TrainerProcesses(args.job, workdir, args.timeout)
    rendezvous, wait = trainers.rendezvous, trainers.wait
    try:
        trainers.start(__file__, args.trainers, "--job", args.job, "--workdir", str(workdir), "--trainers",
                       str(args.trainers), "--ep", str(args.ep), "--masters", args.masters, "--steps", str(args.steps),
                       "--config", str(args.config), "--timeout", str(args.timeout))
        vllm_config = make_vllm_config(args.config)  # while the trainers start
        model = build_model(vllm_config, "cpu")
        reference = build_model(vllm_config, "cpu")
        wait(["bench/layout"], "trainer layout", args.timeout * 4)
        plan_path = workdir / "bench-trainer.plan"
        compile_plan(CompileOptions(str(args.config), trainer_format="stacked", trainer_dtype=args.masters,
                                    trainer_layout=workdir / "trainer-layout.json", output=plan_path))
        plan = load_plan(plan_path)
        receiver = Receiver(plan, 0, model, rendezvous=rendezvous, timeout=args.timeout).start()
        rendezvous.put("bench/plan", str(plan_path).encode())
        bcast = _gloo(rendezvous, "baseline", 1, 2)
        conversion = plan_conversion(vllm_config, plan)
        flat = torch.empty(sum(e.numel for e in plan.sources), dtype=torch.bfloat16)
        wait([f"bench/info/{r}" for r in range(args.trainers)], "trainer staging info")
        info = [rendezvous.get_json(f"bench/info/{r}") for r in range(args.trainers)]
        sizes = {"trainer_bytes": sum(e.nbytes for e in plan.sources),
                 "trainer_bf16_bytes": 2 * sum(e.numel for e in plan.sources), "destination_bytes": receiver.stats.bytes}
        print(json.dumps({"event": "start", "trainers": args.trainers, "ep": args.ep, "masters": args.masters, **sizes,
                          "setup_s": round(time.perf_counter() - began, 1)}),
              flush=True)

        def sync(version: int) -> tuple[float, float]:
            wait([protocol.version_key(r, version) for r in range(args.trainers)], f"version {version}")
            t0 = time.perf_counter()
            receiver.sync(version)
            return time.perf_counter() - t0, time.time()

        def baseline() -> tuple[float, float]:
            _broadcast(bcast, flat, 0)
            t0 = time.perf_counter()
            offset, pairs = 0, []
            for entry in plan.sources:
                pairs.append((entry.name, flat[offset:offset + entry.numel].view(entry.shape)))
                offset += entry.numel
            with torch.no_grad(), parallel_rank(vllm_config, 0, 0):
                reference.load_weights(conversion(iter(pairs)))
                for module in reference.modules():
                    if is_deferred_attention_layer(module):
                        module.process_weights_after_loading(torch.bfloat16)
            return time.time(), time.perf_counter() - t0

        def slowest(key: str) -> list[dict]:
            wait([f"{key}/{r}" for r in range(args.trainers)], key)
            return [rendezvous.get_json(f"{key}/{r}") for r in range(args.trainers)]

        sync(1)
        baseline()
        slowest("bench/base/0")
        rows = []
        for step in range(1, args.steps + 1):
            sync_s, synced = sync(step + 1)
            ours = slowest(f"bench/ours/{step}")
            loaded, load_s = baseline()
            base = slowest(f"bench/base/{step}")
            row = {"step": step, "publish_s": max(r["publish_s"] for r in ours), "sync_s": sync_s,
                   "end_to_end_s": synced - max(r["step_end"] for r in ours),
                   "baseline_s": loaded - max(r["step_end"] for r in base),
                   "baseline_gather_s": max(r["gather_s"] for r in base), "baseline_send_s": base[0]["send_s"],
                   "baseline_load_s": load_s}
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        sync(args.steps + 2)
        synced_digests, loaded_digests = compute_tensor_digests(model), compute_tensor_digests(reference)
        trainers.join()
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "step"}
        worst = max(info, key=lambda i: i["staging_bytes"] / i["shard_bf16_bytes"])
        figures = {
            "publish_s": round(med["publish_s"], 4), "sync_s": round(med["sync_s"], 4),
            "end_to_end_s": round(med["end_to_end_s"], 4), "baseline_s": round(med["baseline_s"], 4),
            "speedup": round(med["baseline_s"] / med["end_to_end_s"], 2),
            "baseline_gather_s": round(med["baseline_gather_s"], 4), "baseline_send_s": round(med["baseline_send_s"], 4),
            "baseline_load_s": round(med["baseline_load_s"], 4),
            "staging_bytes": worst["staging_bytes"], "shard_bf16_bytes": worst["shard_bf16_bytes"],
            "shard_bytes": worst["shard_bytes"], "staged_region_bytes": worst["staged_region_bytes"],
            "packing_bytes": worst["packing_bytes"],
            "staging_ratio": round(worst["staging_bytes"] / worst["shard_bf16_bytes"], 3),
            **sizes,
            "trainers": args.trainers, "ep": args.ep, "masters": args.masters, "steps": args.steps,
            "identical": synced_digests == loaded_digests, "digests": len(synced_digests),
            "seconds": round(time.perf_counter() - began, 1), "load": round(os.getloadavg()[0], 1),
        }
        receiver.close()
        print(json.dumps(figures), flush=True)
        return 0 if figures["identical"] else 1
    finally:
        trainers.close()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trainer_options(p)
    p.add_argument("--steps", type=int, default=3, help="measured steps (each: one step per path)")
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--job", default=f"bench-trainer-{os.getpid()}")
    p.add_argument("--workdir", help="where the plan, the trainer layout and the trainers' logs go (default: a new temp dir)")
    p.add_argument("--smoke", action="store_true", help=f"the smallest run ({' '.join(SMOKE[2:])}, the tiny example config): "
                                                         "checks it runs, not its figures")
    for hidden, kw in (("--role", dict(choices=("inference", "trainer"), default="inference")),
                       ("--rank", dict(type=int, default=0)), ("--address", {})):
        p.add_argument(hidden, help=argparse.SUPPRESS, **kw)
    args = p.parse_args(argv)
    return p.parse_args([*SMOKE, *(argv if argv is not None else sys.argv[1:])]) if args.smoke else args


if __name__ == "__main__":
    arguments = parse_args()
    sys.exit(run_trainer(arguments) if arguments.role == "trainer" else run_inference(arguments))
