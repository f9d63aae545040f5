"""A small MoE trainer as RL trainers run it: transformers' own DeepseekV3ForCausalLM, FSDP2 over gloo on CPU.

Layouts (`parallelize`):
- ep == 1: every parameter FSDP-sharded (Shard(0)) over all ranks.
- ep > 1: a 2-D mesh (dp_shard, ep). Routed experts (`mlp.experts.gate_up_proj` / `down_proj`,
  stacked `[E, ...]` tensors in transformers 5) are `Shard(0)` over `ep` (each EP rank holds E/ep
  experts), then FSDP-sharded over `dp_shard`: FSDP2 records them as
  `(_StridedShard(0, split_factor=ep), Shard(0))` on the 2-D mesh. Everything else is FSDP-sharded
  over all ranks (the flattened mesh), as torchtitan does.

The routed experts' forward is expert-parallel: tokens (and their routing) are all-gathered over
the EP group, each rank runs its local experts on all of them, and an all-reduce sums the experts'
outputs (an "all-gather dispatcher"; gloo has no all-to-all worth using here).

The toy objective (`toy_batch`, `loss_fn`): next-token cross entropy that teaches the model to
continue every prompt with one fixed target phrase, so a few optimizer steps visibly change the
greedy output. Used by examples/rl_loop.py, tests/runtime/test_live_trainer.py and the trainer benchmarks, with the
helpers that start and watch its processes (`add_trainer_options`, `wait_for_keys`, `check_alive`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

CONFIG = Path(__file__).resolve().parent / "configs" / "tiny-deepseek-v3"
ENGINE_CONFIG = CONFIG.parent / "demo-deepseek-v3"  # MLA head dim 576: vLLM's CPU engine runs it
PROMPTS = ((11, 42, 7, 99), (5, 6, 7, 8), (200, 3, 150, 64))
TARGET = (17, 18, 19, 20, 21, 22)


def build_model(config_dir: Path = CONFIG, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """transformers' model for the config, initialised identically on every rank (the same seed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_dir))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # DeepSeek-V3 initialises the router to zeros; random logits make routing (and the demo) more interesting.
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.normal_(0, 0.2)
    return model


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over `group`; the backward sums every rank's gradient and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * ctx.rows:(rank + 1) * ctx.rows], None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over `group`; its gradient is the all-reduced gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ScaleGrad(torch.autograd.Function):
    """Identity whose gradient is multiplied by `scale`."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _ep_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """DeepseekV3Experts.forward with this rank's experts only (their DTensor's local part) over the EP group's tokens."""
    group = self._ep_group
    rank = dist.get_rank(group)
    gate_up, down = self.gate_up_proj, self.down_proj
    gate_up = gate_up.to_local() if hasattr(gate_up, "to_local") else gate_up
    down = down.to_local() if hasattr(down, "to_local") else down
    # FSDP averages expert gradients over dp_shard only, but they already sum the whole EP group's tokens.
    # (set_gradient_divide_factor would do this, with a PREMUL_SUM reduce-scatter gloo lacks for bf16.)
    scale = 1.0 / dist.get_world_size(group)
    gate_up, down = _ScaleGrad.apply(gate_up, scale), _ScaleGrad.apply(down, scale)
    local, first = gate_up.shape[0], rank * gate_up.shape[0]
    rows, width = hidden_states.shape
    # One gather (and so one backward all-reduce) for tokens and routing weights: every rank then runs
    # the same collectives in the same order in backward, whichever experts its tokens hit.
    packed = torch.cat([hidden_states.float(), top_k_weights.float()], dim=1)
    packed = _GatherTokens.apply(packed, group)
    x, weights = packed[:, :width].to(hidden_states.dtype), packed[:, width:].to(top_k_weights.dtype)
    index = [torch.empty_like(top_k_index) for _ in range(dist.get_world_size(group))]
    dist.all_gather(index, top_k_index.contiguous(), group=group)
    index = torch.cat(index)
    out = x * 0.0  # depends on the gathered tokens even where no local expert is hit
    for e in range(local):
        token, pos = torch.where(index == first + e)
        if token.numel() == 0:
            continue
        g, u = torch.nn.functional.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(self.act_fn(g) * u, down[e]) * weights[token, pos, None]
        out = out.index_add(0, token, y.to(out.dtype))
    # Every local expert takes part in the graph, so every rank reduces the same gradients.
    out = out + 0.0 * (gate_up.sum() + down.sum()).to(out.dtype)
    out = _SumOverGroup.apply(out, group)
    return out[rank * rows:(rank + 1) * rows]


def experts_modules(model: torch.nn.Module):
    return [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def parallelize(model: torch.nn.Module, *, ep: int = 1, reshard_after_forward: bool = True,
                param_dtype: torch.dtype | None = None, checkpoint: bool = False) -> torch.nn.Module:
    """FSDP2 over the default process group (gloo), with experts Shard(0) over `ep` on a 2-D (dp_shard, ep) mesh.

    `param_dtype` (e.g. torch.bfloat16) is FSDP2's MixedPrecisionPolicy: compute in it, keep the
    sharded masters in the model's dtype. `checkpoint` wraps every decoder layer in torch's
    activation checkpoint wrapper (its parameter names gain `_checkpoint_wrapped_module.`).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    if world % ep:
        raise ValueError(f"ep={ep} must divide the {world} trainer ranks")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype) if param_dtype is not None else MixedPrecisionPolicy()
    kw = dict(reshard_after_forward=reshard_after_forward, mp_policy=mp)
    if ep > 1:
        mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp_shard", "ep"))
        dense_mesh = mesh["dp_shard", "ep"]._flatten("dp")
        for experts in experts_modules(model):
            for name, param in list(experts.named_parameters(recurse=False)):
                sharded = distribute_tensor(param.data, mesh["ep"], [Shard(0)])
                experts.register_parameter(name, torch.nn.Parameter(sharded, requires_grad=param.requires_grad))
            experts._ep_group = mesh.get_group("ep")
            experts.forward = types.MethodType(_ep_experts_forward, experts)
            fully_shard(experts, mesh=mesh["dp_shard"], **kw)
    else:
        dense_mesh = init_device_mesh("cpu", (world,))
    layers = model.model.layers
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i in range(len(layers)):
            layers[i] = checkpoint_wrapper(layers[i])
    for layer in layers:
        fully_shard(layer, mesh=dense_mesh, **kw)
    fully_shard(model, mesh=dense_mesh, **kw)
    return model


def toy_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every prompt followed by the target phrase; labels only on the phrase (ignore_index -100 elsewhere)."""
    rows = [list(p) + list(TARGET) for p in PROMPTS]
    ids = torch.tensor(rows) % vocab
    labels = ids.clone()
    labels[:, : len(PROMPTS[0])] = -100
    return ids, labels


def train_steps(model, optimizer, n: int) -> float:
    """`n` optimizer steps on the toy objective; returns the last loss (this rank's)."""
    ids, labels = toy_batch(model.config.vocab_size)
    loss = torch.tensor(float("nan"))
    model.train()
    for _ in range(n):
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        optimizer.step()
    return float(loss.detach())


def init_trainer_group(rank: int, world: int, rendezvous) -> None:
    """The trainers' gloo process group, over the job's rendezvous store (already bound to loopback)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.PrefixStore(f"trainers-{rendezvous.job}", rendezvous.store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def dump_json(**fields) -> None:
    print(json.dumps(fields), flush=True)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_trainer_options(p: argparse.ArgumentParser) -> None:
    """--trainers, --ep, --masters (examples/rl_loop.py, benchmarks/bench_trainer.py)."""
    p.add_argument("--trainers", type=int, default=4, help="trainer processes (FSDP2 ranks)")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel degree: experts Shard(0) over a (dp_shard, ep) mesh")
    p.add_argument("--masters", choices=DTYPES, default="fp32",
                   help="fp32: fp32 masters, MixedPrecisionPolicy(param_dtype=bf16), bf16 on the wire; bf16: bf16 masters")


class TrainerProcesses:
    """A benchmark's trainer processes: a store served here, rank r running `python script --role trainer --rank r
    --address <store> ...` with its log in `workdir`, waited for through the store, and killed on `close`."""

    def __init__(self, job: str, workdir: Path, timeout: float):
        from weightplan.runtime import Rendezvous

        self.rendezvous = Rendezvous.connect(job, "127.0.0.1:0", serve=True, timeout=timeout)
        self.workdir, self.timeout, self.procs = workdir, timeout, []

    def start(self, script: str, trainers: int, *argv: str) -> None:
        for rank in range(trainers):
            log = open(self.workdir / f"trainer-{rank}.log", "w")
            self.procs.append(subprocess.Popen(
                [sys.executable, script, "--role", "trainer", "--rank", str(rank), "--address", self.rendezvous.address,
                 *argv], stdout=log, stderr=subprocess.STDOUT,
                # glibc's adaptive mmap threshold would keep freed full-model and gather buffers in the heap
                env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}))

    def wait(self, keys: list[str], what: str, timeout: float | None = None) -> None:
        """Until the trainers put every key (fails early, with its log, if a trainer died)."""
        wait_for_keys(self.rendezvous, keys, what, self.procs, self.workdir, timeout or self.timeout)

    def join(self) -> None:
        """Every trainer exits with status 0 within the timeout, else SystemExit naming its log."""
        for rank, proc in enumerate(self.procs):
            if proc.wait(self.timeout) != 0:
                raise SystemExit(f"trainer {rank} exited with {proc.returncode}; see {self.workdir}/trainer-{rank}.log")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def wait_for_keys(rendezvous, keys: list[str], what: str, procs, workdir: Path, timeout: float) -> None:
    """Poll (every 2 ms) until the trainers put every key; fail early, with its log, if a trainer died."""
    deadline = time.monotonic() + timeout
    for key in keys:
        while not rendezvous.exists(key):
            if time.monotonic() > deadline:
                raise SystemExit(f"no {what} within {timeout} s; see {workdir}/trainer-*.log")
            check_alive(procs, workdir)
            time.sleep(0.002)


def check_alive(procs, workdir: Path) -> None:
    for rank, proc in enumerate(procs):
        if proc.poll() not in (None, 0):
            tail = "\n".join((workdir / f"trainer-{rank}.log").read_text().splitlines()[-25:])
            raise SystemExit(f"trainer {rank} exited with {proc.returncode}:\n{tail}")
