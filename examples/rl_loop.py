"""The whole RL weight-sync loop on one machine: FSDP2 trainers train and publish, a vLLM engine updates and generates.

    python examples/rl_loop.py                  # 4 trainers, experts on a (dp_shard=2, ep=2) mesh, a vLLM engine, 5 steps
    python examples/rl_loop.py --trainers 2 --ep 1 --masters bf16 --steps 3 --check
    python examples/rl_loop.py --inference receiver   # a Receiver into a vLLM model; any config size

This process is the inference side and hosts the rendezvous store; it starts `--trainers`
trainer processes (this same file with `--role trainer`). Then:

1. The trainers build transformers' DeepseekV3ForCausalLM (testing/configs/), shard it with
   FSDP2 over gloo (testing/moe_trainer.py), and trainer 0 writes the live module's trainer
   layout (`write_trainer_layout`). Meanwhile the inference side starts (testing/rl_inference.py).
2. The inference side compiles a plan for exactly that layout (`compile_plan`, trainer format
   `stacked`, the masters' dtype) and announces its path.
3. Every trainer serves its own shards with a `LiveSender`, which checks the plan against the live
   module before registering anything. Version 1 is the initial weights.
4. Each step: the trainers take `--train-steps` optimizer steps on a toy objective (continue every
   prompt with a fixed phrase), `publish`, and `release` (wait for the inference side's ack); the
   inference side updates (one-sided NIXL READs), then generates greedily for a fixed prompt set
   and prints one JSON line: step, loss, update seconds, bytes, the first generated tokens.

`--inference engine` (default): a `vllm.LLM` CPU engine started with dummy weights and the
weightplan weight-transfer backend; every version reaches it through vLLM's own weight-transfer
API and the engine generates (config `testing/configs/demo-deepseek-v3`: MLA head dim 576, which
vLLM's CPU MLA kernel needs). `--inference receiver`: a `Receiver` into a loader-built vLLM model,
generation by transformers on the received bytes (config `testing/configs/tiny-deepseek-v3`).

`--check`: trainer 0 also gathers the full state dict every step (`get_model_state_dict(...,
full_state_dict=True)`), the trainers publish digests and the inference side checks every update's
bytes against them. Engine: after the last step a fresh engine loaded from a safetensors
checkpoint of that state dict must generate the same tokens and logprobs. Receiver: every step,
vLLM's own `load_weights` of it must give the same digests and a fresh transformers load the same
tokens (tests/runtime/test_live_trainer.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402

from weightplan.testing import moe_trainer as mt  # noqa: E402
from weightplan.testing.moe_trainer import DTYPES, add_trainer_options, check_alive, wait_for_keys  # noqa: E402
from weightplan.testing.rl_inference import EngineInference, ReceiverInference  # noqa: E402
from weightplan.runtime import LiveSender, Rendezvous, load_plan, write_trainer_layout  # noqa: E402

INFERENCE = {"engine": (EngineInference, mt.ENGINE_CONFIG), "receiver": (ReceiverInference, mt.CONFIG)}


# ---------------------------------------------------------------------------------------------- trainer


def run_trainer(args) -> None:
    rendezvous = Rendezvous.connect(args.job, args.address, timeout=args.timeout)
    mt.init_trainer_group(args.rank, args.trainers, rendezvous)
    model = mt.build_model(args.config, DTYPES[args.masters])
    mt.parallelize(model, ep=args.ep, reshard_after_forward=not args.keep_unsharded,
                   param_dtype=torch.bfloat16 if args.masters == "fp32" else None, checkpoint=args.checkpoint)
    if args.compile_wrapper:  # torch.compile's wrapper renames parameters `_orig_mod.*`; run eagerly here
        torch._dynamo.config.disable = True
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if args.rank == 0:
        write_trainer_layout(model, Path(args.workdir) / "trainer-layout.json")
        rendezvous.put("demo/layout", b"1")
    rendezvous.wait(["demo/plan"], args.timeout * 4, "the plan from the inference side")
    plan = load_plan(rendezvous.get_bytes("demo/plan").decode())
    sender = LiveSender(plan, args.rank, model, rendezvous=rendezvous, timeout=args.timeout, verify=args.check).start()
    loss = None
    for version in range(1, args.steps + 2):  # version 1: the initial weights
        if version > 1:
            loss = mt.train_steps(model, optimizer, args.train_steps)
        if version == args.reload_at:  # a checkpoint load that reallocates every parameter's storage
            model, optimizer = _reload(model, args)
        if args.check:
            _save_full(model, Path(args.workdir) / f"full-{version}.pt", args.rank)
        if args.rank == 0:
            rendezvous.put(f"demo/loss/{version}", {"loss": loss})
        began = time.perf_counter()
        sender.publish(version)
        report = sender.release(version)
        if args.rank == 0:
            rendezvous.put(f"demo/trainer/{version}", {"publish_release_s": time.perf_counter() - began,
                                                        "reregistered": sender.reregistered,
                                                        "timed_out": list(report.timed_out)})
    sender.close()


def _reload(model, args):
    """Load a copy of the sharded state dict with assign=True (new storages, same values and layout), as a resume does."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    return model, optimizer


def _save_full(model, path: Path, rank: int) -> None:
    """Gather the full state dict (a collective on every rank) and let rank 0 save it for the check."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)


# ---------------------------------------------------------------------------------------------- driver


def run_inference(args) -> int:
    from weightplan.compiler.compile import CompileOptions, compile_plan

    began = time.perf_counter()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="weightplan-rl-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rendezvous = Rendezvous.connect(args.job, "127.0.0.1:0", serve=True, timeout=args.timeout)
    # The trainers get this run's options (flags only when set).
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k not in ("role", "rank", "address", "workdir", "job") and v is not None and type(v) is not bool]
    forwarded += [f"--{k.replace('_', '-')}" for k, v in vars(args).items() if v is True]
    procs, inference = [], None
    try:
        for rank in range(args.trainers):
            log = open(workdir / f"trainer-{rank}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--role", "trainer", "--rank", str(rank), "--address", rendezvous.address,
                 "--job", args.job, "--workdir", str(workdir), *forwarded], stdout=log, stderr=subprocess.STDOUT))
        inference = INFERENCE[args.inference][0](args.config, workdir)  # while the trainers start
        _wait(rendezvous, "demo/layout", procs, workdir, args.timeout * 4)
        plan_path = workdir / "rl-loop.plan"
        compile_plan(CompileOptions(str(args.config), trainer_format="stacked", trainer_dtype=args.masters,
                                    trainer_layout=workdir / "trainer-layout.json", output=plan_path))
        plan = load_plan(plan_path)
        inference.connect(plan, plan_path, rendezvous, timeout=args.timeout, verify=args.check)
        rendezvous.put("demo/plan", str(plan_path).encode())
        print(json.dumps({"event": "start", "inference": args.inference, "trainers": args.trainers, "ep": args.ep, "masters": args.masters, "target": mt.TARGET,
                          "plan": plan.header.trainer.token, "setup_s": round(time.perf_counter() - began, 1)}),
              flush=True)
        for version in range(1, args.steps + 2):
            _wait(rendezvous, f"demo/loss/{version}", procs, workdir, args.timeout * 4)
            line = {"step": version - 1, "loss": rendezvous.get_json(f"demo/loss/{version}")["loss"]}
            line.update(inference.update(version))
            line["tokens"] = inference.generate(mt.PROMPTS, args.new_tokens)
            if args.check:
                full = _wait_file(workdir / f"full-{version}.pt", procs, workdir, args.timeout)
                line.update(inference.check(full, line["tokens"], args.new_tokens, last=version == args.steps + 1))
            _wait(rendezvous, f"demo/trainer/{version}", procs, workdir, args.timeout)
            line["reregistered"] = rendezvous.get_json(f"demo/trainer/{version}")["reregistered"]
            print(json.dumps(line), flush=True)
        for rank, proc in enumerate(procs):
            if proc.wait(args.timeout) != 0:
                raise SystemExit(f"trainer {rank} exited with {proc.returncode}; see {workdir}/trainer-{rank}.log")
        print(json.dumps({"event": "done", "seconds": round(time.perf_counter() - began, 1)}), flush=True)
        return 0
    finally:
        if inference is not None:
            inference.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _wait(rendezvous, key: str, procs, workdir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not rendezvous.exists(key):
        check_alive(procs, workdir)
        if time.monotonic() > deadline:
            raise SystemExit(f"no {key} within {timeout} s; see {workdir}/trainer-*.log")
        time.sleep(0.05)


def _wait_file(path: Path, procs, workdir: Path, timeout: float):
    deadline = time.monotonic() + timeout
    while not path.exists():
        check_alive(procs, workdir)
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path} within {timeout} s")
        time.sleep(0.05)
    return torch.load(path, weights_only=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trainer_options(p)
    p.add_argument("--steps", type=int, default=5, help="publish/sync/generate rounds after the initial weights")
    p.add_argument("--train-steps", type=int, default=2, help="optimizer steps per round")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--inference", choices=INFERENCE, default="engine",
                   help="engine: a vLLM engine with the weightplan backend; receiver: a Receiver into a vLLM model")
    p.add_argument("--config", type=Path, help="model config directory (default: the --inference side's)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--keep-unsharded", action="store_true", help="FSDP2 reshard_after_forward=False")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpoint wrappers on every layer")
    p.add_argument("--compile-wrapper", action="store_true", help="wrap the model in torch.compile (names gain _orig_mod.)")
    p.add_argument("--reload-at", type=int, default=0, help="before publishing this version, reload the state dict with assign=True")
    p.add_argument("--check", action="store_true", help="compare every sync with vLLM's load of the full state dict")
    p.add_argument("--job", default=f"rl-loop-{os.getpid()}")
    p.add_argument("--workdir")
    p.add_argument("--role", choices=("inference", "trainer"), default="inference", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.config is None:
        args.config = INFERENCE[args.inference][1]
    if args.role == "trainer":
        run_trainer(args)
        return 0
    return run_inference(args)


if __name__ == "__main__":
    sys.exit(main())
