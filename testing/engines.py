"""Shared pieces of the vLLM engine tests: trainer weights per version, HF checkpoints, CPU engines, greedy outputs."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]  # the repository: its tests/configs, and what engine workers import
CONFIGS = ROOT / "tests" / "configs"
PROMPTS = [[1, 2, 3, 4, 5], [17, 42, 99, 7], [250, 3, 3, 3, 3, 3, 8, 9]]
MAX_TOKENS = 8


def full_weights(plan, seed: int, version: int) -> dict[str, torch.Tensor]:
    """The trainer's full tensors at `version`: small values (1 ± 0.1 for norms), a function of (seed, version, name)."""
    out = {}
    for entry in plan.sources:
        g = torch.Generator().manual_seed(seed * 1_000_003 + version * 7919 + zlib.crc32(entry.name.encode()))
        value = 0.1 * torch.randn(entry.shape, generator=g)
        if len(entry.shape) == 1 and entry.name.endswith("norm.weight"):
            value += 1.0
        out[entry.name] = value.to(getattr(torch, entry.dtype))
    return out


def sparse_step(previous: dict[str, torch.Tensor], seed: int, changed: float = 0.01) -> dict[str, torch.Tensor]:
    """What an optimizer step does to bf16 weights, roughly: a copy of `previous` with about `changed` of every
    tensor's elements moved by a small random amount (the rest bit-identical), a function of `seed`."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in previous.items():
        hit = torch.rand(t.shape, generator=g) < changed
        out[name] = (t.float() + hit * 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype)
    return out


def local_shards(plan, full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    from weightplan.compiler.verify_plan import shard_sources

    return shard_sources(plan, full, {rank})[rank]


def write_checkpoint(config_dir: Path, full: dict[str, torch.Tensor], out: Path) -> Path:
    """An HF checkpoint (config.json + model.safetensors) of the trainer's tensors, in bf16 as vLLM serves them."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(config_dir / "config.json", out / "config.json")
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in full.items()}, str(out / "model.safetensors"))
    return out


def two_worker_cpu_bind() -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for an engine with two local CPU workers on a one-NUMA-node host: vLLM's automatic
    binding wants a NUMA node per worker and refuses ("Not enough allowed NUMA nodes to bind threads of 2 local
    CPUWorkers"), so one CPU each (`WEIGHTPLAN_TP2_BIND` overrides)."""
    return os.environ.get("WEIGHTPLAN_TP2_BIND", "0|1")


def pin_no_amx(tmp: Path):
    """AMX off in every engine process (vllm_backend/cpu_host.py), with the repository importable by the workers."""
    from weightplan.vllm_backend.cpu_host import pin_no_amx as pin

    return pin(tmp, extra_paths=(str(ROOT),))


def engine_env() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# An explicit KV cache: vLLM's CPU worker otherwise sizes it as gpu_memory_utilization x host memory minus
# the worker's RSS at that moment, which fails ("requested memory for kv (-0.03/0.71 GiB)") whenever the
# worker's resident set happens to exceed that fraction, and so depends on the host and its load.
KV_CACHE_BYTES = 64 << 20


def make_llm(model: Path | str, *, dummy: bool, backend: bool, **kw):
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    engine_env()
    return LLM(model=str(model), load_format="dummy" if dummy else "safetensors", skip_tokenizer_init=True,
               enforce_eager=True, dtype="bfloat16", kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=128, max_num_seqs=4,
               seed=0, weight_transfer_config=WeightTransferConfig(backend="weightplan") if backend else None, **kw)


def greedy(llm) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs for the fixed prompts, one request at a time.

    One at a time because vLLM's CPU MLA engine generates differently for a prompt batched with
    others than alone (a fresh engine: prompt 0's first token is 261 in a batch of three, 307
    alone), and an engine's batching depends on request timing, which differs between engines.
    """
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
    result = []
    for prompt in PROMPTS:
        c = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        result.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return result


class AsyncEngine:
    """An AsyncLLM on an event loop in a helper thread (as an RL framework's rollout server runs it); `run` waits."""

    def __init__(self, model: Path | str, *, dummy: bool, backend: bool, **kw) -> None:
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="async-llm-loop", daemon=True)
        self.thread.start()
        self.engine = self.run(self._start(model, dummy, backend, kw))

    @staticmethod
    async def _start(model, dummy: bool, backend: bool, kw: dict):
        from vllm.config import WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_env()
        return AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=str(model), load_format="dummy" if dummy else "safetensors", skip_tokenizer_init=True,
            enforce_eager=True, dtype="bfloat16", kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=128, max_num_seqs=4, seed=0,
            weight_transfer_config=WeightTransferConfig(backend="weightplan") if backend else None, **kw))

    def run(self, coro, timeout: float = 600):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Shut the engine down and collect it now (at interpreter exit AsyncLLM.__del__ finds vLLM's globals gone)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
            del engine
            gc.collect()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


async def async_greedy(engine, data_parallel_rank: int | None = None) -> list[tuple[list[int], list[float]]]:
    """`greedy` for an AsyncLLM (optionally on one DP rank): tokens and logprobs of the fixed prompts, one at a time."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
    result = []
    for i, prompt in enumerate(PROMPTS):
        final = None
        async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id=f"greedy-{id(params)}-{i}",
                                         data_parallel_rank=data_parallel_rank):
            final = out
        c = final.outputs[0]
        result.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return result


def backend_info(worker) -> dict:
    """A vLLM worker's weightplan backend report (rank, mode, plan, last update): `llm.collective_rpc(backend_info)`."""
    return worker.weight_transfer_engine.info()


def staged_digests(worker) -> dict[str, str]:
    """SHA-256 (as vLLM's compute_tensor_digests) of the loader-layout tensors the weightplan backend staged and rebuilt
    the worker's kernels from: `llm.collective_rpc(staged_digests)`."""
    import hashlib

    return {name: hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for name, t in worker.weight_transfer_engine.destination.tensors.items()}


def kernel_digests(worker) -> dict[str, str]:
    """SHA-256 of every tensor the live model's modules hold (parameters, buffers and tensor attributes like W_UK_T)."""
    return model_digests(worker.model_runner.get_model())


def kernel_digests_differ(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The tensor names two engines' kernel_digests disagree on: held by one only, or with other bytes; sorted."""
    return sorted(set(ours) ^ set(theirs) | {k for k in ours if theirs.get(k) != ours[k]})


def draft_kernel_digests(worker) -> dict[str, str]:
    """kernel_digests of the speculative draft model."""
    return model_digests(worker.get_draft_model())


def model_digests(model) -> dict[str, str]:
    """SHA-256 of every tensor `model`'s modules hold (parameters, buffers, quant method and MoE kernel attributes, cpu_linear closures)."""
    import hashlib

    out = {}

    def add(key, t):
        if isinstance(t, torch.Tensor) and t.numel() and t.device.type != "meta":
            data = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            out[key] = hashlib.sha256(data).hexdigest()[:16]

    for name, module in model.named_modules():
        for attr, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            add(f"{name}.{attr}", t)
        holders = {"": module, "impl.": getattr(module, "impl", None), "qm.": getattr(module, "quant_method", None)}
        kernel = getattr(holders["qm."], "moe_kernel", None)
        holders["kernel."] = kernel
        holders["experts."] = getattr(kernel, "fused_experts", None)
        for prefix, obj in holders.items():
            for attr, value in (vars(obj).items() if obj is not None and hasattr(obj, "__dict__") else ()):
                if attr not in ("_parameters", "_buffers"):
                    add(f"{name}.{prefix}{attr}", value)
        for i, cell in enumerate(getattr(getattr(module, "cpu_linear", None), "__closure__", None) or ()):
            add(f"{name}.cpu_linear[{i}]", cell.cell_contents)
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, log: Path, timeout: float = 300) -> tuple[subprocess.Popen, str]:
    """`vllm serve` (dev-mode RL routes) on dummy weights with the weightplan backend; returns it and its base URL once healthy."""
    import time
    import urllib.request

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        # The API server `vllm serve` runs; vllm-cpu's `vllm` CLI dies reading the version of a distribution
        # named "vllm" (entrypoints/cli/main.py: importlib.metadata.version("vllm")), and it is named vllm-cpu.
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
         "--port", str(port),
         "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16",
         "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--max-model-len", "128", "--max-num-seqs", "4", "--seed", "0",
         "--weight-transfer-config", json.dumps({"backend": "weightplan"})],
        cwd=ROOT, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=5)
            return server, base
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise AssertionError(log.read_text()[-3000:]) from None
            time.sleep(1)


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def start_references(checkpoints: dict[int, Path], out: Path, log: Path) -> subprocess.Popen:
    """A process computing, for each weight set, the greedy outputs of a fresh engine loaded from its checkpoint.

    The engines run one after the other inside that process (engine core and worker in-process:
    VLLM_ENABLE_V1_MULTIPROCESSING=0, executor "uni"), each a new `LLM` reading the checkpoint with
    vLLM's own loader; only the process start is shared.
    """
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    args = [f"{k}={v}" for k, v in checkpoints.items()]
    return subprocess.Popen([sys.executable, "-m", "weightplan.testing.engines", str(out), *args], cwd=ROOT, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def plan_and_checkpoint(model: str, tmp: Path, inference: str = "tp=1"):
    """A plan for tests/configs/`model` (one trainer rank, layout `inference`), weight set 1, and its checkpoint.

    Returns (plan path, plan, the trainer's full tensors, checkpoint directory).
    """
    from weightplan.compiler.compile import CompileOptions, compile_plan
    from weightplan.runtime import load_plan

    plan_path = compile_plan(CompileOptions(model=str(CONFIGS / model), inference=inference, output=tmp / "p.plan")).path
    plan = load_plan(plan_path)
    full = full_weights(plan, 0, 1)
    return plan_path, plan, full, write_checkpoint(CONFIGS / model, full, tmp / "ckpt")


def plan_and_first_reference(model: str, tmp: Path):
    """`plan_and_checkpoint` (tp=1) and a process computing weight set 1's reference on a fresh tp=1 engine.

    Returns (plan path, plan, reference process); `first_reference(proc, tmp)` reads its outputs.
    """
    plan_path, plan, _, checkpoint = plan_and_checkpoint(model, tmp)
    return plan_path, plan, start_references({1: checkpoint}, tmp / "refs.json", tmp / "refs.log")


def first_reference(proc: subprocess.Popen, tmp: Path) -> list:
    return read_references(proc, tmp / "refs.json", tmp / "refs.log")[1]


def read_references(proc: subprocess.Popen, out: Path, log: Path, timeout: float = 600) -> dict[int, list]:
    if proc.wait(timeout) != 0:
        raise AssertionError(f"reference engines failed:\n{log.read_text()[-3000:]}")
    data = json.loads(out.read_text())
    refs = {int(k): [(t, lp) for t, lp in v] for k, v in data.items() if k.isdigit()}
    refs.update({k: v for k, v in data.items() if not k.isdigit()})
    return refs


if __name__ == "__main__":  # python -m weightplan.testing.engines OUT.json SET=CHECKPOINT ...
    results = {}
    for arg in sys.argv[2:]:
        key, _, path = arg.partition("=")
        llm = make_llm(path, dummy=False, backend=False, distributed_executor_backend="uni")
        results[key] = greedy(llm)
        if os.environ.get("WEIGHTPLAN_TEST_DIGESTS"):
            results[f"digests-{key}"] = llm.collective_rpc(kernel_digests)[0]
        shutdown(llm)
    Path(sys.argv[1]).write_text(json.dumps(results))
