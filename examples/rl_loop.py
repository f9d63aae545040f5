"""The whole RL weight-sync loop on one machine: FSDP2 trainers train, publish, and one inference side syncs and generates.

    python examples/rl_loop.py                  # 4 trainer processes, experts on a (dp_shard=2, ep=2) mesh, 5 steps
    python examples/rl_loop.py --trainers 2 --ep 1 --masters bf16 --steps 3 --check

This process is the inference side and hosts the rendezvous store; it starts `--trainers`
trainer processes (this same file with `--role trainer`). Then:

1. The trainers build transformers' DeepseekV3ForCausalLM (tiny config, examples/configs/),
   shard it with FSDP2 over gloo (examples/moe_trainer.py), and trainer 0 writes the live
   module's trainer layout (`write_trainer_layout`).
2. The inference side compiles a plan for exactly that layout (`compile_plan`, trainer format
   `stacked`, the masters' dtype) and announces its path.
3. Every trainer serves its own shards with a `LiveSender`, which checks the plan against the live
   module before registering anything. Version 1 is the initial weights.
4. Each step: the trainers take `--train-steps` optimizer steps on a toy objective (continue every
   prompt with a fixed phrase), `publish`, and `release` (wait for the inference side's ack); the
   inference side `sync`s (one-sided NIXL READs), then generates greedily for a fixed prompt set
   and prints one JSON line: step, loss, update seconds, bytes, the first generated tokens.

The inference side is `ReceiverInference` (a `Receiver` on a vLLM model built as vLLM's loader
builds it, while the trainers start). vLLM's CPU engine cannot run this tiny MLA config (its CPU MLA kernel needs head dim
576) and does not compute from the loader's parameters after loading (docs/trainer.md), so
generation runs transformers' model on the received bytes: after each sync the same plan, run
backwards (destination element -> trainer element, no model-specific mapping), copies the vLLM
parameters into a bf16 transformers model. Swap `ReceiverInference` for an engine-backed class
with the same methods (`__init__(config)`, `connect(plan, rendezvous)`, `update(version)`,
`generate(prompts, n)`) when the vLLM weight-transfer backend lands.

`--check`: trainer 0 also gathers the full state dict every step (`get_model_state_dict(...,
full_state_dict=True)`) and the inference side compares its digests with vLLM's own
`load_weights` of it, and its generated tokens with a fresh transformers load of it (tests).
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
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from examples import moe_trainer as mt  # noqa: E402
from weightplan.runtime import LiveSender, Receiver, Rendezvous, load_plan, write_trainer_layout  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
    sender = LiveSender(plan, args.rank, model, rendezvous=rendezvous, timeout=args.timeout).start()
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


# ---------------------------------------------------------------------------------------------- inference


class ReceiverInference:
    """The inference side: a Receiver on a vLLM model (loader-built, bf16); generation by transformers on the received bytes.

    `__init__(config)` builds the models while the trainers start (as an engine would start), `connect(plan,
    rendezvous)` registers them for the plan, then `update(version)` and `generate(prompts, n)` every step.
    """

    def __init__(self, config: Path):
        from transformers import AutoConfig, AutoModelForCausalLM

        from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config

        self.config = config
        self.vllm_config = make_vllm_config(config)
        self.model = build_model(self.vllm_config, "cpu")
        hf_config = AutoConfig.from_pretrained(str(config))
        hf_config._attn_implementation = "eager"
        # Built on CPU (not meta + to_empty) so its non-persistent buffers (rotary inv_freq) are computed.
        self.generator = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()

    def connect(self, plan, rendezvous, timeout: float = 120.0) -> None:
        self.plan = plan
        self.receiver = Receiver(plan, 0, self.model, rendezvous=rendezvous, timeout=timeout).start()
        self._copies = _inverse_copies(plan, self.generator)

    def update(self, version: int) -> dict:
        report = self.receiver.sync(version)
        params = dict(self.model.named_parameters())
        targets = self.generator.state_dict()
        with torch.no_grad():
            for src, index, dest, start, stop in self._copies:
                targets[src].view(-1)[index] = params[dest].detach().view(-1)[start:stop].to(targets[src].dtype)
        return {"update_s": round(report.seconds, 4), "bytes": report.bytes}

    def generate(self, prompts, n: int) -> list[list[int]]:
        return greedy(self.generator, prompts, n)


def greedy(model, prompts, n: int) -> list[list[int]]:
    with torch.no_grad():
        ids = torch.tensor(prompts)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def _inverse_copies(plan, model) -> list[tuple]:
    """The plan run backwards for inference rank 0: (trainer tensor, its flat element indices, dest, start, stop) per run.

    Every trainer element must land somewhere; the transformers model's own tensors are filled from the vLLM parameters.
    """
    import numpy as np

    targets = model.state_dict()
    runs, covered, copies = plan.runs, {}, []
    index_maps: dict[tuple[int, int], torch.Tensor] = {}
    for i in range(len(runs["src"])):
        dest = plan.dests[int(runs["dest"][i])]
        if 0 not in dest.ranks:
            continue
        src, rank = int(runs["src"][i]), int(runs["src_rank"][i])
        entry = plan.sources[src]
        if (src, rank) not in index_maps:
            grid = torch.arange(entry.numel).view(entry.shape)
            for d, (lo, hi) in enumerate(plan.shard_box(src, rank)):
                grid = grid.narrow(d, lo, hi - lo)
            index_maps[src, rank] = grid.reshape(-1)
        off, length, dst_off = int(runs["src_off"][i]), int(runs["length"][i]), int(runs["dst_off"][i])
        index = index_maps[src, rank][off:off + length]
        copies.append((entry.name, index, dest.name, dst_off, dst_off + length))
        covered.setdefault(entry.name, np.zeros(entry.numel, dtype=bool))[index.numpy()] = True
    for name in targets:
        if name not in covered or not covered[name].all():
            raise SystemExit(f"the plan does not carry every element of {name!r} to inference rank 0; "
                             "generation needs a model whose every trainer tensor reaches vLLM")
    return copies


# ---------------------------------------------------------------------------------------------- check


class FreshLoad:
    """Ground truth for --check: vLLM's own load_weights of the trainer's full state dict, and a fresh transformers load."""

    def __init__(self, config: Path):
        from transformers import AutoConfig, AutoModelForCausalLM

        from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config

        self.config = config
        self.vllm_config = make_vllm_config(config)
        self.reference = build_model(self.vllm_config, "cpu")
        hf_config = AutoConfig.from_pretrained(str(config))
        hf_config._attn_implementation = "eager"
        self.build_hf = lambda: AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()

    def compare(self, full: dict[str, torch.Tensor], inference: ReceiverInference, tokens, n: int) -> dict:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

        from weightplan.compiler.frontend.vllm_patches import parallel_rank
        from weightplan.compiler.verify_plan import plan_conversion

        plan = inference.plan
        names = [e.name for e in plan.sources]
        missing = sorted(set(names) - set(full))
        with torch.no_grad(), parallel_rank(self.vllm_config, 0, 0):
            self.reference.load_weights(plan_conversion(self.vllm_config, plan)((n_, full[n_]) for n_ in names if n_ in full))
            for module in self.reference.modules():
                if is_deferred_attention_layer(module):
                    module.process_weights_after_loading(torch.bfloat16)
        expected, actual = compute_tensor_digests(self.reference), compute_tensor_digests(inference.model)
        differ = sorted(k for k in expected if expected[k] != actual.get(k))
        fresh = self.build_hf()
        fresh.load_state_dict({k: v.to(torch.bfloat16) for k, v in full.items()})
        fresh_tokens = greedy(fresh, mt.PROMPTS, n)
        return {"digests": len(expected), "digests_differ": differ[:5], "n_differ": len(differ),
                "missing_in_full": missing[:5], "fresh_tokens_equal": fresh_tokens == tokens}


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
    procs = []
    try:
        for rank in range(args.trainers):
            log = open(workdir / f"trainer-{rank}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--role", "trainer", "--rank", str(rank), "--address", rendezvous.address,
                 "--job", args.job, "--workdir", str(workdir), *forwarded], stdout=log, stderr=subprocess.STDOUT))
        inference = ReceiverInference(args.config)  # while the trainers start
        check = FreshLoad(args.config) if args.check else None
        _wait(rendezvous, "demo/layout", procs, workdir, args.timeout * 4)
        plan_path = workdir / "rl-loop.plan"
        compile_plan(CompileOptions(str(args.config), trainer_format="stacked", trainer_dtype=args.masters,
                                    trainer_layout=workdir / "trainer-layout.json", output=plan_path))
        plan = load_plan(plan_path)
        inference.connect(plan, rendezvous, timeout=args.timeout)
        rendezvous.put("demo/plan", str(plan_path).encode())
        print(json.dumps({"event": "start", "trainers": args.trainers, "ep": args.ep, "masters": args.masters, "target": mt.TARGET,
                          "plan": plan.header["trainer"]["token"], "setup_s": round(time.perf_counter() - began, 1)}),
              flush=True)
        for version in range(1, args.steps + 2):
            _wait(rendezvous, f"demo/loss/{version}", procs, workdir, args.timeout * 4)
            line = {"step": version - 1, "loss": rendezvous.get_json(f"demo/loss/{version}")["loss"]}
            line.update(inference.update(version))
            line["tokens"] = inference.generate(mt.PROMPTS, args.new_tokens)
            if check is not None:
                full = _wait_file(workdir / f"full-{version}.pt", procs, workdir, args.timeout)
                line.update(check.compare(full, inference, line["tokens"], args.new_tokens))
            _wait(rendezvous, f"demo/trainer/{version}", procs, workdir, args.timeout)
            line["reregistered"] = rendezvous.get_json(f"demo/trainer/{version}")["reregistered"]
            print(json.dumps(line), flush=True)
        for rank, proc in enumerate(procs):
            if proc.wait(args.timeout) != 0:
                raise SystemExit(f"trainer {rank} exited with {proc.returncode}; see {workdir}/trainer-{rank}.log")
        print(json.dumps({"event": "done", "seconds": round(time.perf_counter() - began, 1)}), flush=True)
        return 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _wait(rendezvous, key: str, procs, workdir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not rendezvous.exists(key):
        _check_alive(procs, workdir)
        if time.monotonic() > deadline:
            raise SystemExit(f"no {key} within {timeout} s; see {workdir}/trainer-*.log")
        time.sleep(0.05)


def _wait_file(path: Path, procs, workdir: Path, timeout: float):
    deadline = time.monotonic() + timeout
    while not path.exists():
        _check_alive(procs, workdir)
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path} within {timeout} s")
        time.sleep(0.05)
    return torch.load(path, weights_only=True)


def _check_alive(procs, workdir: Path) -> None:
    for rank, proc in enumerate(procs):
        if proc.poll() not in (None, 0):
            tail = "\n".join((workdir / f"trainer-{rank}.log").read_text().splitlines()[-25:])
            raise SystemExit(f"trainer {rank} exited with {proc.returncode}:\n{tail}")


def add_trainer_options(p: argparse.ArgumentParser) -> None:
    """--trainers, --ep, --masters (shared with benchmarks/bench_trainer.py)."""
    p.add_argument("--trainers", type=int, default=4, help="trainer processes (FSDP2 ranks)")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel degree: experts Shard(0) over a (dp_shard, ep) mesh")
    p.add_argument("--masters", choices=DTYPES, default="fp32",
                   help="fp32: fp32 masters, MixedPrecisionPolicy(param_dtype=bf16), bf16 on the wire; bf16: bf16 masters")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trainer_options(p)
    p.add_argument("--steps", type=int, default=5, help="publish/sync/generate rounds after the initial weights")
    p.add_argument("--train-steps", type=int, default=2, help="optimizer steps per round")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--config", type=Path, default=mt.CONFIG)
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
    if args.role == "trainer":
        run_trainer(args)
        return 0
    return run_inference(args)


if __name__ == "__main__":
    sys.exit(main())
