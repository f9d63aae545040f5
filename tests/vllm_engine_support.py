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

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "tests" / "configs"
PROMPTS = [[1, 2, 3, 4, 5], [17, 42, 99, 7], [250, 3, 3, 3, 3, 3, 8, 9]]
MAX_TOKENS = 8
NO_AMX_PIN = "import torch.cpu\ntorch.cpu._is_amx_tile_supported = lambda: False\n"


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


def pin_no_amx(tmp: Path):
    """Make every engine process (spawned ones via a sitecustomize on PYTHONPATH) see a CPU without AMX tiles.

    Returns a function undoing it (PYTHONPATH and this process's probe), for fixtures' teardown.
    """
    saved_path, saved_probe = os.environ.get("PYTHONPATH"), torch.cpu._is_amx_tile_supported

    def undo() -> None:
        torch.cpu._is_amx_tile_supported = saved_probe
        if saved_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_path

    if os.environ.get("WEIGHTPLAN_TEST_AMX") == "1":  # run the host's own kernels
        return undo
    site = tmp / "no_amx_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(NO_AMX_PIN)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), *filter(None, [saved_path])])
    torch.cpu._is_amx_tile_supported = lambda: False
    return undo


def engine_env() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def make_llm(model: Path | str, *, dummy: bool, backend: bool, memory: float = 0.03, **kw):
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    engine_env()
    return LLM(model=str(model), load_format="dummy" if dummy else "safetensors", skip_tokenizer_init=True,
               enforce_eager=True, dtype="bfloat16", gpu_memory_utilization=memory, max_model_len=128, max_num_seqs=4,
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


def kernel_digests(worker) -> dict[str, str]:
    """SHA-256 of every tensor the live model's modules hold (parameters, buffers and tensor attributes like W_UK_T)."""
    import hashlib

    out = {}

    def add(key, t):
        if isinstance(t, torch.Tensor) and t.numel() and t.device.type != "meta":
            data = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            out[key] = hashlib.sha256(data).hexdigest()[:16]

    for name, module in worker.model_runner.get_model().named_modules():
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
    return subprocess.Popen([sys.executable, "-m", "tests.vllm_engine_support", str(out), *args], cwd=ROOT, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def read_references(proc: subprocess.Popen, out: Path, log: Path, timeout: float = 600) -> dict[int, list]:
    if proc.wait(timeout) != 0:
        raise AssertionError(f"reference engines failed:\n{log.read_text()[-3000:]}")
    data = json.loads(out.read_text())
    refs = {int(k): [(t, lp) for t, lp in v] for k, v in data.items() if k.isdigit()}
    refs.update({k: v for k, v in data.items() if not k.isdigit()})
    return refs


if __name__ == "__main__":  # python -m tests.vllm_engine_support OUT.json SET=CHECKPOINT ...
    results = {}
    for arg in sys.argv[2:]:
        key, _, path = arg.partition("=")
        llm = make_llm(path, dummy=False, backend=False, distributed_executor_backend="uni")
        results[key] = greedy(llm)
        if os.environ.get("WEIGHTPLAN_TEST_DIGESTS"):
            results[f"digests-{key}"] = llm.collective_rpc(kernel_digests)[0]
        shutdown(llm)
    Path(sys.argv[1]).write_text(json.dumps(results))
