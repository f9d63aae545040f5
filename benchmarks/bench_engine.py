"""Benchmark: a weight update of a live vLLM CPU engine through the weightplan backend, against checkpoint reloads.

Usage: python benchmarks/bench_engine.py [--updates N] [--smoke]   (make bench-engine)

A DeepSeek-V3-shaped MLA model of about 1 GB in bf16 (benchmarks/configs/bench-deepseek-v3), bf16
trainer tensors on 2 trainer processes (FSDP=2: this process is rank 0 and drives the engine,
testing/engine_trainer.py is rank 1), one `vllm.LLM` CPU engine (tp=1) started with
`load_format="dummy"`:
  (a)  our update (send_weights at trainer rank 0: publish, start/update/finish on the engine,
       release), split on the engine into transfer (the NIXL sync into staging) and
       post-processing (rebuilding packed layers, MLA's absorbed weights); median over updates
       after the first; cold_start_s is engine start + the first update (weights from trainers);
  (b)  what frameworks do without a transfer engine: the trainer writes a safetensors checkpoint
       and the engine takes it, by `reload_weights(weights_path=...)` if vLLM can run that here,
       else by restarting the engine on the checkpoint (checkpoint_path says which);
  (c)  vLLM's own layerwise reload (initialize_layerwise_reload + load_weights of full in-memory
       tensors + finalize_layerwise_reload, what its nccl/ipc backends run), or null and why.
  (d)  the pause: the engine rejoins in a second job with delta syncs on (`delta=0.5` on every trainer and the
       engine); version 1 (full, a warm-up), then alternately a version that changes about 1% of the elements of
       the previous one (what an optimizer step does to bf16 weights: taken as a delta) and a new random weight set
       (its delta would exceed the trainers' delta regions: taken full), `updates` of each; every update prefetched
       (send_weights(prefetch=True): the workers read the version in the background while the engine may
       generate, and the update call only applies it). full_pause_s and delta_pause_s: the median time the engine's
       worker spent inside the update calls of the full and of the delta updates (the window in which it can run
       no forward pass); full_pause_unprefetched_s: the same for (a), whose updates are not prefetched.
--smoke runs the same steps on tests/configs/engine-deepseek-v3 (a tiny MLA model) with 2 updates: it checks that
they run, not the figures (tests/e2e/test_benchmark_smoke.py). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "benchmarks" / "configs" / "bench-deepseek-v3"
SMOKE_CONFIG = ROOT / "tests" / "configs" / "engine-deepseek-v3"
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with functions (benchmark only)


def layerwise_reload(worker, path: str) -> float:
    """vLLM's layerwise reload fed from full in-memory tensors (read before the clock starts)."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    tensors = load_file(str(Path(path) / "model.safetensors"))
    model = worker.model_runner.get_model()
    began = time.perf_counter()
    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(model)
        model.load_weights(iter(tensors.items()))
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
    return time.perf_counter() - began


def wait_for(path: Path, text: str, proc: subprocess.Popen) -> None:
    """Until `text` appears in a trainer worker's output; exit with its output if it died."""
    while text not in path.read_text():
        if proc.poll() is not None:
            raise SystemExit(path.read_text()[-3000:])
        time.sleep(0.2)


def delta_pauses(llm, plan, plan_path: Path, tmp: Path, updates: int) -> dict:
    """(d): rejoin the engine in job bench-engine-delta with delta syncs on; version 1 full, then `updates` sparse
    steps (deltas) alternating with `updates` new weight sets (full), every update prefetched; the engine's pauses."""
    from weightplan.testing.engines import backend_info, full_weights, local_shards, sparse_step
    from weightplan.runtime import Rendezvous
    from weightplan.vllm_backend.clients import LLMClient
    from weightplan.vllm_backend.trainer import ShardSource, WeightplanTrainerEngine, WeightplanTrainerInitInfo

    llm.shutdown_weight_transfer_engine()
    job = "bench-engine-delta"
    full = full_weights(plan, 0, 1)
    tensors = local_shards(plan, full, 0)
    info = WeightplanTrainerInitInfo(rank=0, plan=str(plan_path), address="127.0.0.1:0", job=job, timeout=300, delta=0.5)
    trainer = WeightplanTrainerEngine.trainer_init(info, client=LLMClient(llm), source=ShardSource(tensors))
    gate = Rendezvous.connect(job, info.address, timeout=300)
    log = tmp / "rank1-delta.out"
    sets = [1] + [x for k in range(updates) for x in ("s", k + 2)]  # as testing/engine_trainer.py reads them
    rank1 = subprocess.Popen([sys.executable, "-m", "weightplan.testing.engine_trainer", "--plan", str(plan_path), "--rank", "1",
                              "--address", info.address, "--job", job, "--timeout", "300", "--sets", ",".join(map(str, sets)),
                              "--delta", "0.5"], cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    wait_for(log, '"ready"', rank1)
    rows = []
    for version in range(1, len(sets) + 1):
        if version > 1:
            step = sets[version - 1]
            full = sparse_step(full, version) if step == "s" else full_weights(plan, 0, step)
            for name, value in local_shards(plan, full, 0).items():
                tensors[name].copy_(value)
        wait_for(log, f'"prepared", "version": {version}}}', rank1)
        gate.put(f"test/go/{version}", b"1")
        t = time.perf_counter()
        trainer.send_weights(version, prefetch=True)
        wall = time.perf_counter() - t
        e = llm.collective_rpc(backend_info)[0]
        rows.append(e)
        print(f"delta job v{version}: {wall:.3f} s, took {e['took']} ({e['bytes'] / 1e9:.4f} GB read), prefetched "
              f"{e['prefetched']}: transfer {e['transfer_s']:.3f} s in the background, pause {e['pause_s']:.3f} s "
              f"(waiting {e['wait_s']:.3f} s, post-process {e['post_process_s']:.3f} s)")
    gate.put(f"test/stop/{len(sets) + 1}", b"1")
    gate.put(f"test/go/{len(sets) + 1}", b"1")
    rank1.wait(60)
    trainer.shutdown()
    took = [e["took"] for e in rows]
    if took != ["full"] + ["delta", "full"] * updates:
        raise SystemExit(f"the delta job's updates took {took}: expected full, then delta and full alternately")
    deltas, fulls = rows[1::2], rows[2::2]
    return {"full_pause_s": round(statistics.median(e["pause_s"] for e in fulls), 4),
            "delta_pause_s": round(statistics.median(e["pause_s"] for e in deltas), 4),
            "delta_transfer_s": round(statistics.median(e["transfer_s"] for e in deltas), 4),
            "delta_wire_ratio": round(statistics.median(e["bytes"] for e in deltas) / rows[0]["bytes"], 4)}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, help="updates through the backend (default 4; 2 with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and 2 updates: checks it runs, not its figures")
    args = parser.parse_args()
    config = SMOKE_CONFIG if args.smoke else CONFIG
    if args.updates is None:
        args.updates = 2 if args.smoke else 4
    if args.updates < 1:
        parser.error("--updates must be at least 1")
    from weightplan.testing.engines import backend_info, full_weights, greedy, local_shards, make_llm, pin_no_amx, shutdown, write_checkpoint
    from weightplan.compiler.compile import CompileOptions, compile_plan
    from weightplan.runtime import Rendezvous, load_plan
    from weightplan.vllm_backend.clients import LLMClient
    from weightplan.vllm_backend.trainer import ShardSource, WeightplanTrainerEngine, WeightplanTrainerInitInfo

    tmp = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    pin_no_amx(tmp)
    plan_path = compile_plan(CompileOptions(model=str(config), trainer="fsdp=2", output=tmp / "fsdp2.plan")).path
    plan = load_plan(plan_path)
    gb = sum(e.nbytes for e in plan.dests) / 1e9
    print(f"model {config.name}: {gb:.2f} GB of bf16 parameters, plan {plan.n_runs} runs, trainer fsdp=2, engine tp=1")
    tensors = local_shards(plan, full_weights(plan, 0, 1), 0)

    began = time.perf_counter()
    llm = make_llm(config, dummy=True, backend=True)
    engine_start = time.perf_counter() - began
    info = WeightplanTrainerInitInfo(rank=0, plan=str(plan_path), address="127.0.0.1:0", job="bench-engine", timeout=300)
    trainer = WeightplanTrainerEngine.trainer_init(info, client=LLMClient(llm), source=ShardSource(tensors))
    gate = Rendezvous.connect("bench-engine", info.address, timeout=300)
    sets = ",".join(str(v) for v in range(1, args.updates + 1))
    out = open(tmp / "rank1.out", "w")
    rank1 = subprocess.Popen([sys.executable, "-m", "weightplan.testing.engine_trainer", "--plan", str(plan_path), "--rank", "1",
                              "--address", info.address, "--job", "bench-engine", "--timeout", "300", "--sets", sets],
                             cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    wait_for(tmp / "rank1.out", '"ready"', rank1)
    rows = []
    for version in range(1, args.updates + 1):
        if version > 1:
            for name, value in local_shards(plan, full_weights(plan, 0, version), 0).items():
                tensors[name].copy_(value)
        wait_for(tmp / "rank1.out", f'"prepared", "version": {version}}}', rank1)  # rank 1's new values are ready
        t = time.perf_counter()
        gate.put(f"test/go/{version}", b"1")
        trainer.send_weights(version)
        wall = time.perf_counter() - t
        e = llm.collective_rpc(backend_info)[0]
        rows.append((wall, e["transfer_s"], e["post_process_s"], e["pause_s"]))
        print(f"update v{version}: {wall:.3f} s (engine: transfer {e['transfer_s']:.3f} s, post-process "
              f"{e['post_process_s']:.3f} s, {e['bytes'] / 1e9:.2f} GB, {e['descriptors']} descriptors, {e['mode']} mode)")
    ours = greedy(llm)
    cold_start = engine_start + rows[0][0]
    steady = rows[1:] or rows
    update_s, transfer_s, post_s, pause_s = (statistics.median(r[i] for r in steady) for i in range(4))
    gate.put(f"test/stop/{args.updates + 1}", b"1")
    gate.put(f"test/go/{args.updates + 1}", b"1")
    rank1.wait(60)
    trainer.shutdown()
    pauses = delta_pauses(llm, plan, plan_path, tmp, args.updates)
    shutdown(llm)

    full = full_weights(plan, 0, args.updates)  # the trainer's tensors; only writing them is timed
    previous = write_checkpoint(config, full_weights(plan, 0, 1), tmp / "ckpt-previous")
    t = time.perf_counter()
    ckpt = write_checkpoint(config, full, tmp / "ckpt")
    write_s = time.perf_counter() - t
    del full
    t = time.perf_counter()
    llm = make_llm(previous, dummy=False, backend=False)  # serving version 1, as after a restart
    checkpoint_cold_start = time.perf_counter() - t
    first = greedy(llm)
    print(f"checkpoint: written in {write_s:.2f} s; an engine started on a checkpoint in {checkpoint_cold_start:.2f} s")
    checkpoint_path, checkpoint_reload = "restart", write_s + checkpoint_cold_start
    try:
        t = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(ckpt)})
        reload_s = time.perf_counter() - t
        right = greedy(llm) == ours  # must now generate what our engine generated with the same weights
        print(f"reload_weights(weights_path=...) ran in {reload_s:.2f} s; generates the checkpoint's weights: {right}")
        if right:
            checkpoint_path, checkpoint_reload = "reload", write_s + reload_s
    except Exception as exc:
        print(f"reload_weights(weights_path=...) fails on this engine: {first_line(exc)}")
    load_weights_reload, why = None, None
    try:
        seconds = llm.collective_rpc(layerwise_reload, args=(str(previous),))[0]
        if greedy(llm) == first:
            load_weights_reload = seconds
        else:
            why = "runs, but the engine then does not generate what the loaded weights generate"
    except Exception as exc:
        why = first_line(exc)
    if why:
        print(f"vLLM's layerwise reload (load_weights) unavailable here: {why}")
    shutdown(llm)

    result = {
        "update_s": round(update_s, 4), "transfer_s": round(transfer_s, 4), "post_process_s": round(post_s, 4),
        "checkpoint_reload_s": round(checkpoint_reload, 3), "checkpoint_path": checkpoint_path,
        "load_weights_reload_s": None if load_weights_reload is None else round(load_weights_reload, 4),
        "speedup_vs_checkpoint": round(checkpoint_reload / update_s, 2),
        "speedup_vs_load_weights": None if load_weights_reload is None else round(load_weights_reload / update_s, 2),
        "cold_start_s": round(cold_start, 3), "checkpoint_cold_start_s": round(checkpoint_cold_start, 3),
        "gb": round(gb, 3), "load_weights_unavailable": why,
        "full_pause_unprefetched_s": round(pause_s, 4), **pauses,
    }
    print(f"ours {update_s:.3f} s per update vs {checkpoint_path} from a checkpoint {checkpoint_reload:.2f} s: "
          f"{result['speedup_vs_checkpoint']}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
