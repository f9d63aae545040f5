"""The prepared GPU check (`make gpu-check`): what the GPU path proves on a GPU, each part ok, skipped or failed.

Usage: python benchmarks/gpu_check.py [--device cuda|cpu] [--parts NAME,...] [--mib N]

Needs only PyTorch with CUDA (and numpy). NIXL (`nixl_cu13` or `nixl_cu12`) and vLLM are used where importable;
a part that needs what is missing prints `skipped` with the reason, so the report says what was and was not
proven. Parts:

- `fp8_quantizer`: the runtime's device fp8 path on the GPU, byte-equal to the host path (the numba kernel when
  numba imports, else its torch reference) and, with vLLM, to vLLM's per_block_cast_to_fp8 on the GPU; GB/s.
- `ordering_device`: a tensor written by a kernel still running on a side stream is read from another stream only
  after the runtime's DeviceSync (a control read without it must see the old bytes, or the check is inconclusive).
- `sync_vram`: a Sender and a Receiver in two processes on one GPU, both sides in device memory (NIXL VRAM);
  every destination's SHA-256 equals the host executor's for three versions.
- `sync_host_sender`: the same with the sender's tensors in host memory, the receiver's on the GPU.
- `sync_vs_copy`: the VRAM sync's GB/s against a device-to-device copy of the same bytes.
- `ordering_sync`: the trainer's writes of a version run in a kernel still sleeping on a side stream when it calls
  publish(); the receiver must get the new bytes. The same run with the sender's device wait disabled must not
  (else the check could not catch an early read, and says so).
- `sync_fp8`: an fp8_per_block plan (benchmarks/data/gpu-check-fp8.plan: tiny DeepSeek-V3 shapes, 3 trainer ranks,
  2 tp ranks, with sender-, gather- and receiver-side blocks) synced by 5 processes with every tensor on the GPU:
  fp8 regions, gathers, staging slots and quantization on the device; each destination's SHA-256 equals the host
  executor's for three versions.

`--device cpu` runs the sync and ordering parts on host memory (this machine's self-test of the harness; the
device itself is then not proven; `sync_fp8` then takes the GPU's fp8 code path on host tensors, fp8_path="device"). Without CUDA and without `--device cpu` every part prints skipped and the
command exits 0. The last line is JSON: {"parts": {NAME: {"status": ..., "reason": ..., figures...}}}.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("fp8_quantizer", "ordering_device", "sync_vram", "sync_host_sender", "sync_vs_copy", "ordering_sync", "sync_fp8")
SYNC_PARTS = PARTS[2:]
FP8_PLAN = ROOT / "benchmarks" / "data" / "gpu-check-fp8.plan"  # compiled here (the GPU machine has no vLLM)
VERSIONS = 3
SLEEP_CYCLES = 400_000_000  # torch.cuda._sleep: a few hundred ms on current GPUs, far longer than a sync of the test plan


def _weightplan() -> None:
    """Make `weightplan.runtime` (and the plan writer) importable from this checkout when the project is not installed
    (a lent GPU machine without internet), mapping the packages as pyproject.toml does."""
    try:
        importlib.import_module("weightplan.runtime")
        return
    except ImportError:
        pass
    for name, folder in (("weightplan", "weightplan"), ("weightplan.runtime", "runtime"), ("weightplan.compiler", "compiler")):
        spec = importlib.util.spec_from_file_location(name, ROOT / folder / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:  # noqa: BLE001 - a broken install is as absent as a missing one here
        return False


def nixl_module() -> str | None:
    return next((m for m in ("nixl_cu13._api", "nixl_cu12._api") if _importable(m)), None)


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def failed(reason: str, **figures) -> dict:
    return {"status": "failed", "reason": reason, **figures}


def ok(reason: str, **figures) -> dict:
    return {"status": "ok", "reason": reason, **figures}


def _cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- fp8 ----------------------------------------------------------------------------------------------------------

def fp8_quantizer(device: str) -> dict:
    if device != "cuda":
        return skipped("needs a GPU: the device path on host tensors is tested by tests/runtime/test_device_fp8.py")
    from weightplan.runtime.fp8.numerics import BlockQuantizer, quantize_on_device

    kernel = _importable("numba")
    host_path = BlockQuantizer("cuda", use_kernel=kernel)
    g = torch.Generator().manual_seed(0)
    cases = {"4096x7168": (torch.randn(4096, 7168, generator=g) * 0.02), "129x257": torch.randn(129, 257, generator=g),
             "5x300 tiny": torch.randn(5, 300, generator=g) * 1e-6, "256x384 large": torch.randn(256, 384, generator=g) * 3e4}
    special = torch.randn(512, 384, generator=g)
    special[:128, :128] = 0
    special[128:256, :128] = torch.finfo(torch.bfloat16).max
    special[:128, 128:256] = float("inf")
    special[256:384, :128] = float("nan")
    cases["special tiles"] = special
    mismatched, vllm_mismatched = [], []
    vllm = _importable("vllm.utils.deep_gemm")
    for name, x in cases.items():
        x = x.to(torch.bfloat16)
        values, scales = quantize_on_device(x.cuda(), rounding="cuda")
        host_values = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        host_scales = torch.empty(-(-x.shape[0] // 128), -(-x.shape[1] // 128))
        host_path(x, host_values, host_scales)
        if not (_same(values.cpu(), host_values) and _same(scales.cpu(), host_scales)):
            mismatched.append(name)
        if vllm:
            from vllm.utils.deep_gemm import per_block_cast_to_fp8

            ref_values, ref_scales = per_block_cast_to_fp8(x.cuda(), block_size=[128, 128], use_ue8m0=False)
            if not (_same(values, ref_values) and _same(scales, ref_scales)):
                vllm_mismatched.append(name)
    big = cases["4096x7168"].to(torch.bfloat16).cuda()
    quantize_on_device(big, rounding="cuda")
    _cuda_sync()
    began, repeats = time.perf_counter(), 20
    for _ in range(repeats):
        quantize_on_device(big, rounding="cuda")
    _cuda_sync()
    gbps = big.numel() * 2 * repeats / (time.perf_counter() - began) / 1e9
    against = f"the host path ({'numba kernel' if kernel else 'torch reference: numba not importable'})"
    figures = {"gbytes_per_s_bf16_in": round(gbps, 2), "host_path": "numba" if kernel else "torch",
               "vllm_compared": vllm}
    if mismatched or vllm_mismatched:
        return failed(f"bytes differ from {against} in {mismatched} and from vLLM in {vllm_mismatched}", **figures)
    return ok(f"byte-equal to {against}" + (" and to vLLM's per_block_cast_to_fp8 on the GPU" if vllm else
                                             "; vLLM not importable, not compared with vLLM on the GPU"), **figures)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ---- ordering on the device ---------------------------------------------------------------------------------------

def ordering_device(device: str) -> dict:
    if device != "cuda":
        return skipped("needs a GPU: the hooks are tested here with a recording fake stream (tests/runtime/test_gpu_memory.py)")
    from weightplan.runtime.device import DeviceSync

    def trial(wait: bool) -> bool:
        """True if a read from another stream saw the bytes a still-sleeping side-stream kernel writes."""
        t = torch.zeros(1 << 20, device="cuda")
        _cuda_sync()
        writer, reader = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(writer):
            torch.cuda._sleep(SLEEP_CYCLES)
            t.fill_(1.0)
        if wait:
            DeviceSync.of([t]).wait("gpu check")
        seen = torch.empty(t.shape, pin_memory=True)
        with torch.cuda.stream(reader):
            seen.copy_(t, non_blocking=True)
        reader.synchronize()
        _cuda_sync()
        return bool((seen == 1.0).all())

    waited, control = trial(True), trial(False)
    if not waited:
        return failed("a read after DeviceSync.wait saw bytes from before the side stream's kernel finished")
    if control:
        return failed("inconclusive: the control read without a wait also saw the new bytes (kernel too short?)")
    return ok("a read after DeviceSync.wait saw the side stream's writes; the control without it saw the old bytes")


# ---- syncs between processes --------------------------------------------------------------------------------------

def identity_plan(out: Path, tensors: int, numel: int) -> Path:
    """One trainer rank to one inference rank: `tensors` bf16 tensors of `numel` elements, each one run in place."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from synthetic_plans import write_synthetic

    from weightplan.compiler.ir import Runs, TensorEntry

    n = np.arange(tensors, dtype=np.int64)
    zeros = np.zeros(tensors, dtype=np.int64)
    runs = Runs(src=n, src_off=zeros, dest=n, dst_off=zeros, length=np.full(tensors, numel, dtype=np.int64), wire=zeros,
                src_rank=zeros, count=np.ones(tensors, dtype=np.int64), src_stride=zeros, dst_stride=zeros)
    sources = tuple(TensorEntry(f"layers.{i}.weight", (numel,), "bfloat16") for i in range(tensors))
    dests = tuple(TensorEntry(f"layers.{i}.weight", (numel,), "bfloat16", ranks=(0,)) for i in range(tensors))
    return write_synthetic(out, f"gpu-check-{tensors}x{numel}", sources, dests, runs, 1, 1)


def values(plan, version: int) -> dict[str, torch.Tensor]:
    """Trainer rank 0's tensors at `version`, made on the host (both processes make them; the receiver hashes them)."""
    out = {}
    for i, entry in enumerate(plan.sources):
        g = torch.Generator().manual_seed(1000 * i + version)
        out[entry.name] = torch.randn(entry.shape, generator=g).to(torch.bfloat16)
    return out


def expected_digests(plan, version: int) -> dict[str, str]:
    """SHA-256 per destination of what the host executor writes from `values(plan, version)`."""
    from weightplan.runtime import execute_local

    destination = {e.name: torch.zeros(e.shape, dtype=getattr(torch, e.dtype)) for e in plan.dests}
    execute_local(plan, {0: values(plan, version)}, {0: destination})
    return {name: _digest(t) for name, t in destination.items()}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def sender_worker(args) -> None:
    from weightplan.runtime import Rendezvous, Sender, load_plan
    from weightplan.runtime.device import DeviceSync
    from weightplan.runtime.transport import protocol

    plan = load_plan(args.plan)
    rendezvous = Rendezvous.connect(args.job, args.address, timeout=120)
    device = torch.device(args.sender_device)
    tensors = {name: t.to(device) for name, t in values(plan, 1).items()}
    # release() waits for the inference ranks that joined: publish only once the receiver has.
    rendezvous.wait([protocol.joined_key(0)], 120, "the gpu check's receiver process")
    with Sender(plan, 0, tensors, rendezvous=rendezvous, timeout=120) as sender:
        if args.no_device_wait:
            sender.device_sync = DeviceSync(())  # the control: publish without waiting for the device
        for version in range(1, VERSIONS + 1):
            if version > 1:
                sender.release(version - 1)
                new = {name: t.pin_memory() if device.type == "cuda" else t for name, t in values(plan, version).items()}
                side = torch.cuda.Stream(device) if device.type == "cuda" else None
                if side is not None and args.late_writes:
                    with torch.cuda.stream(side):
                        torch.cuda._sleep(SLEEP_CYCLES)  # the "optimizer step" still running when publish is called
                        for name, t in tensors.items():
                            t.copy_(new[name], non_blocking=True)
                else:
                    for name, t in tensors.items():
                        t.copy_(new[name])
            sender.publish(version)
        report = sender.release(VERSIONS)
    print(json.dumps({"acked": list(report.acked)}), flush=True)


def receiver_worker(args) -> None:
    from weightplan.runtime import Receiver, Rendezvous, load_plan

    plan = load_plan(args.plan)
    rendezvous = Rendezvous.connect(args.job, args.address, timeout=120)
    device = torch.device(args.receiver_device)
    destination = {e.name: torch.zeros(e.shape, dtype=getattr(torch, e.dtype), device=device) for e in plan.dests}
    rows = []
    with Receiver(plan, 0, destination, rendezvous=rendezvous, timeout=120, derived="caller") as receiver:
        for version in range(1, VERSIONS + 1):
            report = receiver.sync(version)
            ours = {name: _digest(t) for name, t in destination.items()}
            rows.append({"version": version, "seconds": report.seconds, "bytes": report.bytes,
                         "equal": ours == expected_digests(plan, version)})
    copy = float("nan")
    if device.type == "cuda":  # the same bytes copied device to device, best of 5
        flat = [t.view(-1) for t in destination.values()]
        twins = [torch.empty_like(t) for t in flat]
        best = float("inf")
        for _ in range(5):
            _cuda_sync()
            began = time.perf_counter()
            for a, b in zip(twins, flat):
                a.copy_(b)
            _cuda_sync()
            best = min(best, time.perf_counter() - began)
        copy = sum(t.numel() * t.element_size() for t in flat) / best / 1e9
    print(json.dumps({"versions": rows, "copy_gbytes_per_s": copy}), flush=True)


def run_sync(plan: Path, sender_device: str, receiver_device: str, *, late_writes: bool = False,
             no_device_wait: bool = False) -> dict:
    """One sender and one receiver process syncing VERSIONS versions; the receiver's JSON, or {'error': ...}."""
    from weightplan.runtime import Rendezvous

    job = f"gpucheck{os.getpid()}x{int(time.time() * 1000) % 10**9}"
    rendezvous = Rendezvous.connect(job, "127.0.0.1:0", serve=True, timeout=120)
    common = [sys.executable, __file__, "--plan", str(plan), "--job", job, "--address", rendezvous.address,
              "--sender-device", sender_device, "--receiver-device", receiver_device]
    common += ["--late-writes"] if late_writes else []
    common += ["--no-device-wait"] if no_device_wait else []
    outs = run_workers({role: common + ["--worker", role] for role in ("sender", "receiver")})
    return outs if "error" in outs else outs["receiver"]


def run_workers(commands: dict[str, list[str]]) -> dict:
    """Run the worker processes together; each one's last JSON line by name, or {'error': ...} naming the first that failed."""
    procs = {name: subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, command in commands.items()}
    outs = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        outs[name] = (proc.returncode, out, err)
    for name, (code, out, err) in outs.items():
        if code != 0 or not out.strip():
            sys.stderr.write(f"--- {name} process (exit {code}) ---\n{err[-3000:]}\n")
            lines = [line for line in err.strip().splitlines() if "Error" in line] or err.strip().splitlines() or ["no output"]
            return {"error": f"the {name} process exited with {code}: {lines[-1][:300]}"}
    return {name: json.loads(out.strip().splitlines()[-1]) for name, (_, out, _) in outs.items()}


# ---- an fp8_per_block plan between processes ----------------------------------------------------------------------

def fp8_shards(plan, version: int) -> dict[int, dict[str, torch.Tensor]]:
    """Every trainer rank's local shards at `version`, cut from full tensors made on the host (weights of 0.02 scale)."""
    full = {}
    for i, entry in enumerate(plan.sources):
        g = torch.Generator().manual_seed(1000 * i + version)
        full[entry.name] = (torch.randn(entry.shape, generator=g) * 0.02).to(getattr(torch, entry.dtype))
    out = {}
    for rank in range(plan.header.src_ranks):
        out[rank] = {}
        for i, entry in enumerate(plan.sources):
            box = plan.shard_box(i, rank)
            if box is not None:
                out[rank][entry.name] = full[entry.name][tuple(slice(lo, hi) for lo, hi in box)].contiguous()
    return out


def fp8_destination(plan, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    return {e.name: torch.zeros(e.shape, dtype=getattr(torch, e.dtype), device=device) for e in plan.dests if rank in e.ranks}


def fp8_sender_worker(args) -> None:
    from weightplan.runtime import Rendezvous, Sender, load_plan
    from weightplan.runtime.transport import protocol

    plan = load_plan(args.plan)
    rendezvous = Rendezvous.connect(args.job, args.address, timeout=120)
    device = torch.device(args.sender_device)
    tensors = {name: t.to(device) for name, t in fp8_shards(plan, 1)[args.rank].items()}
    with Sender(plan, args.rank, tensors, rendezvous=rendezvous, timeout=120, fp8_path="device") as sender:
        rendezvous.wait([protocol.joined_key(k) for k in sender.readers], 120, "the gpu check's receiver processes")
        for version in range(1, VERSIONS + 1):
            if version > 1:
                sender.release(version - 1)
                for name, t in fp8_shards(plan, version)[args.rank].items():
                    tensors[name].copy_(t)
            sender.publish(version)
        report = sender.release(VERSIONS)
    print(json.dumps({"acked": list(report.acked), "quantize_seconds": sender.quantize_seconds}), flush=True)


def fp8_receiver_worker(args) -> None:
    from weightplan.runtime import Receiver, Rendezvous, execute_local, load_plan

    plan = load_plan(args.plan)
    rendezvous = Rendezvous.connect(args.job, args.address, timeout=120)
    destination = fp8_destination(plan, args.rank, torch.device(args.receiver_device))
    rows = []
    with Receiver(plan, args.rank, destination, rendezvous=rendezvous, timeout=120, derived="caller",
                  fp8_path="device") as receiver:
        for version in range(1, VERSIONS + 1):
            report = receiver.sync(version)
            expected = {args.rank: fp8_destination(plan, args.rank, torch.device("cpu"))}
            execute_local(plan, fp8_shards(plan, version), expected)
            rows.append({"version": version, "seconds": report.seconds, "bytes": report.bytes,
                         "quantize_seconds": report.quantize_seconds,
                         "equal": {n: _digest(t) for n, t in destination.items()}
                         == {n: _digest(t) for n, t in expected[args.rank].items()}})
    print(json.dumps({"versions": rows}), flush=True)


def sync_fp8(device: str) -> dict:
    from weightplan.runtime import Rendezvous, load_plan

    plan = load_plan(FP8_PLAN)
    job = f"gpucheckfp8{os.getpid()}x{int(time.time() * 1000) % 10**9}"
    rendezvous = Rendezvous.connect(job, "127.0.0.1:0", serve=True, timeout=120)
    common = [sys.executable, __file__, "--plan", str(FP8_PLAN), "--job", job, "--address", rendezvous.address,
              "--sender-device", device, "--receiver-device", device]
    commands = {f"trainer {r}": common + ["--worker", "fp8-sender", "--rank", str(r)] for r in range(plan.header.src_ranks)}
    commands |= {f"inference {k}": common + ["--worker", "fp8-receiver", "--rank", str(k)] for k in range(plan.header.dst_ranks)}
    outs = run_workers(commands)
    if "error" in outs:
        return failed(outs["error"])
    receivers = [outs[f"inference {k}"]["versions"] for k in range(plan.header.dst_ranks)]
    figures = {"trainers": plan.header.src_ranks, "receivers": plan.header.dst_ranks, "versions": VERSIONS,
               "bytes_per_version": sum(rows[-1]["bytes"] for rows in receivers),
               "worst_sync_s": round(max(r["seconds"] for rows in receivers for r in rows), 4)}
    bad = [(k, r["version"]) for k, rows in enumerate(receivers) for r in rows if not r["equal"]]
    where = f"{device} on both sides, fp8 work on the {'GPU' if device == 'cuda' else 'host through the GPU code path'}"
    if bad:
        return failed(f"{where}: digests differ from the host executor's at (inference rank, version) {bad}", **figures)
    return ok(f"{where}: every destination's SHA-256 equals the host executor's on {len(receivers)} inference ranks, "
              f"{VERSIONS} versions", **figures)


def sync_parts(device: str, mib: int, wanted: set[str]) -> dict:
    results = {}
    names = [p for p in SYNC_PARTS if p in wanted]
    if not names:
        return results
    if device == "cuda" and not torch.cuda.is_available():
        return {p: skipped("no CUDA device") for p in names}
    module = nixl_module()
    if module is None:
        return {p: skipped("NIXL not importable: carry the nixl-cu13==1.5.1 wheel (docs/runtime.md, GPUs)") for p in names}
    if "sync_fp8" in names:
        results["sync_fp8"] = sync_fp8(device)
    if not set(names) - {"sync_fp8"}:
        return results
    with tempfile.TemporaryDirectory() as tmp:
        numel = max(1, mib << 20) // 2 // 8
        plan = identity_plan(Path(tmp) / "gpu-check.plan", 8, numel)
        vram = run_sync(plan, device, device) if {"sync_vram", "sync_vs_copy"} & set(names) else None
        if "sync_vram" in names:
            results["sync_vram"] = _sync_result(vram, f"{device} to {device}")
        if "sync_host_sender" in names:
            results["sync_host_sender"] = _sync_result(run_sync(plan, "cpu", device), f"host to {device}")
        if "sync_vs_copy" in names:
            if "error" in vram or device != "cuda":
                results["sync_vs_copy"] = skipped(vram.get("error", "needs a GPU (a device-to-device copy)"))
            else:
                sync = max(r["bytes"] / r["seconds"] / 1e9 for r in vram["versions"])
                results["sync_vs_copy"] = ok("best sync of the VRAM run against the best of 5 device copies",
                                             sync_gbytes_per_s=round(sync, 2), copy_gbytes_per_s=round(vram["copy_gbytes_per_s"], 2),
                                             ratio=round(sync / vram["copy_gbytes_per_s"], 3))
        if "ordering_sync" in names:
            if device != "cuda":
                results["ordering_sync"] = skipped("needs a GPU: host tensors have no asynchronous writes")
            else:
                waited = run_sync(plan, device, device, late_writes=True)
                control = run_sync(plan, device, device, late_writes=True, no_device_wait=True)
                if "error" in waited:
                    results["ordering_sync"] = failed(waited["error"])
                elif not all(r["equal"] for r in waited["versions"]):
                    results["ordering_sync"] = failed("the receiver got bytes from before the trainer's kernels finished")
                elif "error" not in control and all(r["equal"] for r in control["versions"]):
                    results["ordering_sync"] = failed("inconclusive: without the device wait the receiver still got the "
                                                      "new bytes (the sleeping kernel was too short to be caught)")
                else:
                    results["ordering_sync"] = ok("late writes arrived whole with the device wait; without it the "
                                                  "receiver read early (the check catches an early read)")
    return {p: results[p] for p in names}


def _sync_result(out: dict, what: str) -> dict:
    if "error" in out:
        return failed(out["error"])
    rows = out["versions"]
    figures = {"versions": len(rows), "bytes": rows[-1]["bytes"],
               "best_gbytes_per_s": round(max(r["bytes"] / r["seconds"] / 1e9 for r in rows), 2)}
    if not all(r["equal"] for r in rows):
        return failed(f"{what}: digests differ from the host executor's in versions "
                      f"{[r['version'] for r in rows if not r['equal']]}", **figures)
    return ok(f"{what}: every destination's SHA-256 equals the host executor's, {len(rows)} versions", **figures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--mib", type=int, default=256, help="bytes the sync parts move per version, in MiB")
    parser.add_argument("--worker", choices=tuple(WORKERS))
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--plan")
    parser.add_argument("--job")
    parser.add_argument("--address")
    parser.add_argument("--sender-device", default="cuda")
    parser.add_argument("--receiver-device", default="cuda")
    parser.add_argument("--late-writes", action="store_true")
    parser.add_argument("--no-device-wait", action="store_true")
    args = parser.parse_args()
    _weightplan()
    if args.worker:
        WORKERS[args.worker](args)
        return
    wanted = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = wanted - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    cuda = torch.cuda.is_available()
    print(f"torch {torch.__version__}, CUDA {'available: ' + torch.cuda.get_device_name(0) if cuda else 'not available'}, "
          f"NIXL {nixl_module() or 'not importable'}, vLLM {'installed' if importlib.util.find_spec('vllm') else 'not installed'}",
          flush=True)
    parts: dict[str, dict] = {}
    for name, check in (("fp8_quantizer", fp8_quantizer), ("ordering_device", ordering_device)):
        if name not in wanted:
            continue
        if args.device == "cuda" and not cuda:
            parts[name] = skipped("no CUDA device")
            continue
        try:
            parts[name] = check(args.device)
        except Exception as exc:  # noqa: BLE001 - a part that breaks is reported as failed, the others still run
            parts[name] = failed(f"{type(exc).__name__}: {str(exc)[:200]}")
            traceback.print_exc()
    try:
        parts.update(sync_parts(args.device, args.mib, wanted))
    except Exception as exc:  # noqa: BLE001 - as above
        parts.update({p: failed(f"{type(exc).__name__}: {str(exc)[:200]}") for p in SYNC_PARTS if p in wanted})
        traceback.print_exc()
    for name in PARTS:
        if name in parts:
            print(f"{name}: {parts[name]['status']} ({parts[name]['reason']})", flush=True)
    print(json.dumps({"parts": {p: parts[p] for p in PARTS if p in parts}}), flush=True)
    sys.exit(1 if any(p["status"] == "failed" for p in parts.values()) else 0)


WORKERS = {"sender": sender_worker, "receiver": receiver_worker, "fp8-sender": fp8_sender_worker,
           "fp8-receiver": fp8_receiver_worker}

if __name__ == "__main__":
    main()
