"""The prepared GPU check (`make gpu-check`): what the GPU path proves on a GPU, each part ok, skipped or failed.

Usage: python benchmarks/gpu_check.py [--device cuda|cpu] [--parts NAME,...] [--mib N] [--logs DIR]

Run from the repository root of a GPU machine with `.gpu/` (`make gpu-bundle`) beside it: the pruned NIXL for
CUDA 13 is unpacked from there when no NIXL imports, and vLLM's per_block_cast_to_fp8 is loaded from its source there
when vLLM is not installed. Needs PyTorch with CUDA; without PyTorch or without a GPU every part prints `skipped`
with its reason and the command exits 0. Every part runs in its own process under its own deadline (all of them
together within 5 minutes), and every worker's stdout and stderr is kept in the logs folder the JSON names. Parts:

- `fp8_quantizer`: under ScaleRounding.CUDA, on the GPU, the Triton kernel, the torch path (quantize_on_device), vLLM's
  per_block_cast_to_fp8 run there (the CUDA rule by definition) and the host path give the same bytes; GB/s of the
  Triton kernel (target: 1,000 of bf16 input).
- `delta_rates`: device delta encode and apply rates (weightplan.runtime.delta.measure_device).
- `ordering_device`: a read after the runtime's DeviceSync sees a still-sleeping side-stream kernel's writes; a
  control read without it does not.
- `copies`: a device-to-device copy and a pinned host-to-device copy of the sync's bytes (the targets' yardsticks).
- `sync_vram`: a Sender and a Receiver in two processes on one GPU, both in device memory, 2 GiB in 8 tensors, once
  per transport variant (UCX_TLS lists, and the runtime's own CUDA IPC path where the Receiver has it); every
  destination byte-equal to the trainer's tensors for 3 versions; which UCX transports carried the READs (target:
  0.5 of the device copy).
- `sync_host_sender`: the same with the trainer's tensors in pinned host memory (target: 0.8 of the pinned copy).
- `ordering_sync`: the trainer's writes of a version still run in a kernel sleeping 20x the sync time measured by
  `sync_vram` when it calls publish(); the receiver must get the new bytes, and the same run with the sender's device
  wait disabled must not.
- `sync_fp8`: an fp8_per_block plan (benchmarks/data/gpu-check-fp8.plan: tiny DeepSeek-V3 shapes, 3 trainer ranks,
  2 tp ranks, with sender-, gather- and receiver-side blocks) synced by 5 processes with every tensor on the GPU;
  each destination's SHA-256 equals the host executor's for three versions.

`--device cpu` runs the sync parts on host memory (the harness's self-test here; the device itself is not proven).
The last line is JSON: {"parts": {NAME: {"status", "reason", figures...}}, "targets": ..., FIGURES..., "logs": DIR}.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

# PyTorch and numpy are imported by _import_torch(), not here: a python without them prints every part skipped.
torch = np = None

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / ".gpu"
sys.path.insert(0, str(ROOT / "benchmarks"))

PARTS = ("fp8_quantizer", "delta_rates", "ordering_device", "copies", "sync_vram", "sync_host_sender", "ordering_sync",
         "sync_fp8")
FIGURES = ("sync_gbytes_per_s", "copy_gbytes_per_s", "pinned_h2d_gbytes_per_s", "quantizer_gbytes_per_s",
           "delta_encode_gbytes_per_s", "delta_apply_gbytes_per_s")
TARGETS = {"sync_vram_vs_copy": 0.5, "host_sync_vs_pinned_h2d": 0.8, "quantizer_gbytes_per_s": 1000.0}
# Seconds per part; the driver gives a part at most what is left of TOTAL_S.
DEADLINES = {"fp8_quantizer": 45, "delta_rates": 20, "ordering_device": 15, "copies": 15, "sync_vram": 100,
             "sync_host_sender": 30, "ordering_sync": 45, "sync_fp8": 30}
TOTAL_S = 285
CPU_SLACK = 4  # --device cpu (the harness's self-test) runs on small shared hosts: its deadlines are this many times longer
VARIANT_S = 25  # one sync_vram variant: start, 3 versions of 2 GiB, digests
FP8_PLAN = ROOT / "benchmarks" / "data" / "gpu-check-fp8.plan"  # compiled here (the GPU machine has no vLLM)
VERSIONS = 3
SYNC_TENSORS = 8
ORDERING_MIB = 64
UCX_VARIANTS = (("default", None), ("cuda_ipc,cuda_copy,tcp,self", "cuda_ipc,cuda_copy,tcp,self"),
                ("sm,cuda_ipc,cuda_copy,self", "sm,cuda_ipc,cuda_copy,self"))


def skipped(reason: str, **figures) -> dict:
    return {"status": "skipped", "reason": reason, **figures}


def failed(reason: str, **figures) -> dict:
    return {"status": "failed", "reason": reason, **figures}


def ok(reason: str, **figures) -> dict:
    return {"status": "ok", "reason": reason, **figures}


def sleep_cycles(sync_seconds: float, clock_hz: float, factor: float = 20.0, floor_s: float = 0.2,
                 cap_s: float = 15.0) -> tuple[int, float]:
    """(cycles, seconds) for torch.cuda._sleep so a kernel outlasts `factor` times a sync of `sync_seconds`, at least
    `floor_s` and at most `cap_s`. `clock_hz` is the GPU's highest SM clock: _sleep counts cycles, so at any lower
    clock the kernel sleeps longer, never shorter."""
    if not sync_seconds >= 0 or not clock_hz > 0:
        raise ValueError(f"sleep_cycles needs a sync time >= 0 and a clock > 0, got {sync_seconds!r} s, {clock_hz!r} Hz")
    seconds = min(cap_s, max(floor_s, factor * sync_seconds))
    return int(seconds * clock_hz), seconds


def _import_torch() -> str | None:
    """Import PyTorch and numpy into this module; None, or why they are not there."""
    global torch, np
    try:
        torch = importlib.import_module("torch")
        np = importlib.import_module("numpy")
    except Exception as exc:  # noqa: BLE001 - a broken install is as absent as a missing one here
        return f"no PyTorch in {sys.executable} ({type(exc).__name__}: {str(exc)[:120]})"
    return None


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
    except Exception:  # noqa: BLE001 - as above
        return False


def nixl_module() -> str | None:
    return next((m for m in ("nixl_cu13._api", "nixl_cu12._api") if _importable(m)), None)


def use_bundle() -> dict:
    """Put the bundle's NIXL on sys.path and PYTHONPATH (for workers) when no NIXL imports; what was found."""
    found = {"folder": str(BUNDLE), "manifest": None, "nixl_from": None}
    manifest = BUNDLE / "manifest.json"
    if manifest.exists():
        found["manifest"] = {k: v for k, v in json.loads(manifest.read_text()).items() if k in ("vllm", "bytes")}
    archive = BUNDLE / "nixl-cu13.tar.xz"
    if archive.exists() and not _importable("nixl_cu13._api") and not _importable("nixl_cu12._api"):
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()[:12]
        # Unpacked outside the checkout: 66 MiB inside it would be carried back to the next GPU call.
        target = Path(tempfile.gettempdir()) / f"weightplan-gpu-nixl-{digest}"
        if not (target / "nixl_cu13").is_dir():
            partial = Path(tempfile.mkdtemp(prefix="weightplan-gpu-nixl-"))
            with tarfile.open(archive) as tar:
                tar.extractall(partial, filter="data")
            os.replace(partial, target)
        sys.path.insert(0, str(target))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH")) if p)
        importlib.invalidate_caches()
        found["nixl_from"] = str(target)
    return found


def ucx_modules_loadable(folder: str | None) -> dict | None:
    """Whether each UCX module of the unpacked bundle loads here (after PyTorch loaded the CUDA runtime): UCX drops a
    module it cannot dlopen without an error, and without libuct_cuda there is no cuda_ipc or cuda_copy."""
    if folder is None:
        return None
    import ctypes

    out = {}
    for path in sorted(Path(folder).glob("*.libs/ucx/lib*.so*")):
        try:
            ctypes.CDLL(str(path))
            out[path.name] = "loads"
        except OSError as exc:
            out[path.name] = str(exc)[-200:]
    return out


def vllm_per_block_cast():
    """(vLLM's per_block_cast_to_fp8, where from): the installed vLLM's, else the bundle's copy of its source."""
    if _importable("vllm.utils.deep_gemm"):
        from vllm.utils.deep_gemm import per_block_cast_to_fp8

        return per_block_cast_to_fp8, "installed vLLM"
    path = BUNDLE / "vllm_fp8.py"
    if not path.exists():
        return None, "vLLM not installed and no .gpu/vllm_fp8.py (run make gpu-bundle where vLLM is)"
    spec = importlib.util.spec_from_file_location("gpu_bundle_vllm_fp8", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.per_block_cast_to_fp8, f"{path} ({module.__doc__.split()[1]})"


def _cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _same(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _timed(fn, repeats: int) -> float:
    """Seconds per call of `fn` on the GPU (CUDA events), after one warm-up call."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


# ---- fp8 ----------------------------------------------------------------------------------------------------------

def fp8_cases() -> dict:
    g = torch.Generator().manual_seed(0)
    cases = {"4096x7168": torch.randn(4096, 7168, generator=g) * 0.02, "129x257": torch.randn(129, 257, generator=g),
             "5x300 tiny": torch.randn(5, 300, generator=g) * 1e-6, "256x384 large": torch.randn(256, 384, generator=g) * 3e4}
    special = torch.randn(512, 384, generator=g)
    special[:128, :128] = 0
    special[128:256, :128] = torch.finfo(torch.bfloat16).max
    special[:128, 128:256] = float("inf")
    special[256:384, :128] = float("nan")
    special[384:, 256:] *= 1e-40  # subnormal tile
    cases["special tiles"] = special
    return {name: x.to(torch.bfloat16) for name, x in cases.items()}


def fp8_quantizer(args, state: dict) -> dict:
    """Every quantizing path under each scale rounding against the host path (numba, the bytes the CPU tests prove), and
    vLLM's own function on the GPU against the CUDA rounding; the Triton kernel's GB/s of bf16 input."""
    from weightplan.runtime.fp8.numerics import BlockQuantizer, quantize_on_device
    from weightplan.runtime.fp8.rounding import ScaleRounding
    from weightplan.runtime.fp8.triton_quant import quantize_tiles_triton

    vllm_fn, vllm_from = vllm_per_block_cast()
    numba = _importable("numba")
    differ: dict[str, list[str]] = {}
    for rounding in ScaleRounding:
        host = BlockQuantizer(rounding, use_kernel=numba)
        for name, x in fp8_cases().items():
            dev = x.cuda()
            values = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
            scales = torch.empty(-(-x.shape[0] // 128), -(-x.shape[1] // 128))
            host(x, values, scales)
            out = {"torch": quantize_on_device(dev, rounding=rounding)}
            if vllm_fn and rounding is ScaleRounding.CUDA:
                out["vllm"] = vllm_fn(dev, block_size=[128, 128], use_ue8m0=False)
            hf, wf = x.shape[0] // 128 * 128, x.shape[1] // 128 * 128
            if hf and wf:
                v = torch.zeros(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
                s = torch.zeros(scales.shape, device="cuda")
                quantize_tiles_triton(dev, v, s, hf, wf, rounding)
                out["triton"] = (v, s)
            for path, (v, s) in out.items():
                rows, cols = (hf, wf) if path == "triton" else x.shape  # the kernel writes whole tiles only
                same = _same(v[:rows, :cols].cpu(), values[:rows, :cols]) and \
                    _same(s[: -(-rows // 128), : -(-cols // 128)].cpu(), scales[: -(-rows // 128), : -(-cols // 128)])
                if not same:
                    differ.setdefault(f"{path}/{rounding.value}", []).append(name)
    big = torch.randn(16384, 16384, device="cuda").to(torch.bfloat16)  # 512 MiB: far beyond the 60 MB L2
    cuda = ScaleRounding.CUDA
    figures = {"reference": f"host path ({'numba' if numba else 'torch reference'})", "vllm_from": vllm_from}
    figures["torch_gbytes_per_s"] = round(big.numel() * 2 / _timed(lambda: quantize_on_device(big, rounding=cuda), 5) / 1e9, 1)
    v = torch.empty(big.shape, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(128, 128, device="cuda")
    rate = big.numel() * 2 / _timed(lambda: quantize_tiles_triton(big, v, s, 16384, 16384, cuda), 20) / 1e9
    figures["triton_gbytes_per_s"] = state["quantizer_gbytes_per_s"] = round(rate, 1)
    if differ:
        return failed(f"bytes differ from the host path in {differ}", **figures)
    return ok(f"torch, Triton{', vLLM (cuda)' if vllm_fn else ''} and the host path give the same bytes under both scale "
              f"roundings on {len(fp8_cases())} cases", **figures)


def delta_rates(args, state: dict) -> dict:
    from weightplan.runtime.delta.measure_device import measure_delta_device_rates

    rates = measure_delta_device_rates("cuda")
    if rates.get("status") != "ok":
        return skipped(rates.get("reason", str(rates)[:200]))
    for key in ("delta_encode_gbytes_per_s", "delta_apply_gbytes_per_s"):
        state[key] = rates[key]
    return ok("device delta encode and apply, byte-equal to the host codec", **rates)


def ordering_device(args, state: dict) -> dict:
    from weightplan.runtime.device import DeviceSync

    cycles, seconds = sleep_cycles(0.0, _max_clock_hz(), floor_s=0.5)

    def trial(wait: bool) -> bool:
        """True if a read from another stream saw the bytes a still-sleeping side-stream kernel writes."""
        t = torch.zeros(1 << 20, device="cuda")
        _cuda_sync()
        writer, reader = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(writer):
            torch.cuda._sleep(cycles)
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
        return failed(f"the control read without a wait saw the new bytes although the kernel slept {seconds} s")
    return ok("a read after DeviceSync.wait saw the side stream's writes; the control without it saw the old bytes",
              sleep_s=seconds)


def _max_clock_hz() -> float:
    """The GPU's highest SM clock (device properties, kHz), or 2.1 GHz, above any current data-centre GPU's boost."""
    khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", None)
    return khz * 1e3 if khz else 2.1e9


def copies(args, state: dict) -> dict:
    """The sync's bytes (2 GiB in 8 tensors by default) copied device to device and pinned host to device, best of 5."""
    numel = (args.mib << 20) // 2 // SYNC_TENSORS
    dst = [torch.empty(numel, dtype=torch.bfloat16, device="cuda") for _ in range(SYNC_TENSORS)]
    src = [torch.ones(numel, dtype=torch.bfloat16, device="cuda") for _ in range(SYNC_TENSORS)]
    pinned = [torch.ones(numel, dtype=torch.bfloat16).pin_memory() for _ in range(SYNC_TENSORS)]
    nbytes = numel * 2 * SYNC_TENSORS

    def best(sources) -> float:
        fastest = float("inf")
        for _ in range(5):
            _cuda_sync()
            began = time.perf_counter()
            for a, b in zip(dst, sources):
                a.copy_(b, non_blocking=True)
            _cuda_sync()
            fastest = min(fastest, time.perf_counter() - began)
        return nbytes / fastest / 1e9

    state["copy_gbytes_per_s"] = round(best(src), 1)
    state["pinned_h2d_gbytes_per_s"] = round(best(pinned), 2)
    return ok(f"{nbytes >> 20} MiB in {SYNC_TENSORS} tensors, best of 5", bytes=nbytes,
              copy_gbytes_per_s=state["copy_gbytes_per_s"], pinned_h2d_gbytes_per_s=state["pinned_h2d_gbytes_per_s"])


# ---- syncs between processes --------------------------------------------------------------------------------------

def identity_plan(out: Path, tensors: int, numel: int) -> Path:
    """One trainer rank to one inference rank: `tensors` bf16 tensors of `numel` elements, each one run in place."""
    from synthetic_plans import write_synthetic

    from weightplan.compiler.ir import Runs, TensorEntry

    n = np.arange(tensors, dtype=np.int64)
    zeros = np.zeros(tensors, dtype=np.int64)
    runs = Runs(src=n, src_off=zeros, dest=n, dst_off=zeros, length=np.full(tensors, numel, dtype=np.int64), wire=zeros,
                src_rank=zeros, count=np.ones(tensors, dtype=np.int64), src_stride=zeros, dst_stride=zeros)
    sources = tuple(TensorEntry(f"layers.{i}.weight", (numel,), "bfloat16") for i in range(tensors))
    dests = tuple(TensorEntry(f"layers.{i}.weight", (numel,), "bfloat16", ranks=(0,)) for i in range(tensors))
    return write_synthetic(out, f"gpu-check-{tensors}x{numel}", sources, dests, runs, 1, 1)


def version_values(plan, version: int, device) -> dict:
    """Trainer rank 0's tensors at `version`, drawn on `device` from seeds both processes know (the receiver redraws
    them to check its bytes: an identity plan's destinations equal its sources)."""
    out = {}
    for i, entry in enumerate(plan.sources):
        g = torch.Generator(device=device).manual_seed(1000 * i + version)
        out[entry.name] = torch.randn(entry.shape, generator=g, device=device, dtype=torch.bfloat16)
    return out


def _digest(t) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def sender_worker(args) -> None:
    from weightplan.runtime import Rendezvous, Sender, load_plan
    from weightplan.runtime.device import DeviceSync
    from weightplan.runtime.transport import protocol

    plan = load_plan(args.plan)
    rendezvous = Rendezvous.connect(args.job, args.address, timeout=args.timeout)
    device = torch.device(args.sender_device)
    draw = torch.device("cuda") if torch.cuda.is_available() else device  # host tensors are drawn on the GPU, copied
    tensors = {n: t.to(device) for n, t in version_values(plan, 1, draw).items()}
    if device.type == "cpu" and torch.cuda.is_available():
        tensors = {n: t.pin_memory() for n, t in tensors.items()}
    rendezvous.wait([protocol.joined_key(0)], args.timeout, "the gpu check's receiver process")
    with Sender(plan, 0, tensors, rendezvous=rendezvous, timeout=args.timeout) as sender:
        if args.no_device_wait:
            sender.device_sync = DeviceSync(())  # the control: publish without waiting for the device
        for version in range(1, args.versions + 1):
            if version > 1:
                sender.release(version - 1)
                new = version_values(plan, version, draw)
                if args.late_writes:
                    _cuda_sync()
                    with torch.cuda.stream(torch.cuda.Stream(device)):
                        torch.cuda._sleep(args.sleep_cycles)  # the "optimizer step" still running at publish()
                        for name, t in tensors.items():
                            t.copy_(new[name], non_blocking=True)
                else:
                    for name, t in tensors.items():
                        t.copy_(new[name])
            sender.publish(version)
        report = sender.release(args.versions)
    print(json.dumps({"acked": list(report.acked)}), flush=True)


def receiver_worker(args) -> None:
    from weightplan.runtime import Receiver, Rendezvous, load_plan

    plan = load_plan(args.plan)
    rendezvous = Rendezvous.connect(args.job, args.address, timeout=args.timeout)
    device = torch.device(args.receiver_device)
    destination = {e.name: torch.zeros(e.shape, dtype=getattr(torch, e.dtype), device=device) for e in plan.dests}
    extra = {"device_ipc": args.device_ipc} if args.device_ipc else {}
    rows = []
    with Receiver(plan, 0, destination, rendezvous=rendezvous, timeout=args.timeout, derived="caller", **extra) as receiver:
        for version in range(1, args.versions + 1):
            report = receiver.sync(version)
            expected = version_values(plan, version, device)
            equal = all(torch.equal(destination[n].view(torch.int16), t.view(torch.int16)) for n, t in expected.items())
            rows.append({"version": version, "seconds": report.seconds, "bytes": report.bytes, "equal": equal,
                         "paths": report.paths})
    print(json.dumps({"versions": rows}), flush=True)


def run_workers(commands: dict[str, list[str]], logs: Path, tag: str, deadline: float, env: dict | None = None) -> dict:
    """Run worker processes together, each one's stdout and stderr kept in `logs`; {name: its last JSON line}, or
    {"error": one line, ...} naming the first that failed or every one still running at the deadline (then killed)."""
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": os.environ.get("UCX_LOG_LEVEL", "info"),
           "PYTHONUNBUFFERED": "1", **(env or {})}
    procs, files = {}, {}
    for name, command in commands.items():
        stem = f"{tag}.{name.replace(' ', '-')}"
        out, err = (logs / f"{stem}.stdout").open("w"), (logs / f"{stem}.stderr").open("w")
        files[name] = (out, err, logs / f"{stem}.stdout", logs / f"{stem}.stderr")
        procs[name] = subprocess.Popen(command, stdout=out, stderr=err, env=env, start_new_session=True)
    end = time.monotonic() + deadline
    late = []
    for name, proc in procs.items():
        try:
            proc.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            late.append(name)
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session: it and anything it started
            proc.wait()
    for out, err, *_ in files.values():
        out.close()
        err.close()
    text = "".join(p.read_text(errors="replace") for _, _, *paths in files.values() for p in paths)
    result = {"logs": sorted(p.name for _, _, *paths in files.values() for p in paths), "ucx_text": text}
    if late:
        return {**result, "error": f"{', '.join(late)} still running after the {deadline:.0f} s deadline: killed"}
    for name, proc in procs.items():
        stdout, stderr = (files[name][2].read_text(errors="replace"), files[name][3].read_text(errors="replace"))
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            said = [line for line in stderr.strip().splitlines() if "Error" in line or "error" in line]
            said = said or stderr.strip().splitlines() or ["no output"]
            return {**result, "error": f"the {name} process exited with {proc.returncode}: {said[-1][:300]}"}
        result[name] = json.loads(lines[-1])
    return result


def run_sync(args, plan: Path, tag: str, deadline: float, *, sender_device: str, receiver_device: str,
             env: dict | None = None, device_ipc: str | None = None, versions: int = VERSIONS,
             late_writes: bool = False, no_device_wait: bool = False, sleep: int = 0) -> dict:
    """One sender and one receiver process syncing `versions` versions: the receiver's rows, transports and logs."""
    from ucx_proto_info import transports

    from weightplan.runtime import Rendezvous

    job = f"gpucheck{os.getpid()}x{int(time.time() * 1000) % 10**9}"
    timeout = max(5.0, deadline - 5)  # the runtime's own timeouts end a stuck sync with its error before the kill
    secret = secrets.token_hex(32)  # a Receiver reads a trainer of its host directly only in a job with a secret
    env = {**(env or {}), "WEIGHTPLAN_SECRET": secret}
    rendezvous = Rendezvous.connect(job, "127.0.0.1:0", serve=True, timeout=timeout, secret=secret)
    common = [sys.executable, __file__, "--plan", str(plan), "--job", job, "--address", rendezvous.address,
              "--sender-device", sender_device, "--receiver-device", receiver_device, "--versions", str(versions),
              "--timeout", str(timeout), "--sleep-cycles", str(sleep)]
    common += ["--device-ipc", device_ipc] if device_ipc else []
    common += ["--late-writes"] if late_writes else []
    common += ["--no-device-wait"] if no_device_wait else []
    outs = run_workers({role: common + ["--worker", role] for role in ("sender", "receiver")}, Path(args.logs), tag,
                       deadline, env)
    found = {"logs": outs["logs"], "transports": transports(outs["ucx_text"])}
    if "error" in outs:
        return {**found, "error": outs["error"]}
    return {**found, "versions": outs["receiver"]["versions"]}


def _rates(rows: list[dict]) -> dict:
    best = max(r["bytes"] / r["seconds"] / 1e9 for r in rows)
    steady = [r["seconds"] for r in rows[1:]] or [rows[0]["seconds"]]
    paths = {}
    for r in rows:
        for k, v in (r.get("paths") or {}).items():
            paths[k] = paths.get(k, 0) + v
    return {"best_gbytes_per_s": round(best, 3), "seconds": [round(r["seconds"], 4) for r in rows],
            "slowest_steady_s": max(steady), "bytes": rows[-1]["bytes"], "paths": paths or None}


def _variant(out: dict, **what) -> dict:
    if "error" in out:
        return {"status": "error", "reason": out["error"], "transports": out["transports"]["read"],
                "logs": out["logs"], **what}
    rows = out["versions"]
    bad = [r["version"] for r in rows if not r["equal"]]
    status = "failed" if bad else "ok"
    reason = f"bytes differ from the trainer's in versions {bad}" if bad else f"byte-equal in {len(rows)} versions"
    return {"status": status, "reason": reason, **_rates(rows), "transports": out["transports"]["read"],
            "transports_detail": out["transports"]["read_detail"], "logs": out["logs"], **what}


def _sync_plan(args, tmp: Path, mib: int) -> Path:
    numel = max(1, mib << 20) // 2 // SYNC_TENSORS
    return identity_plan(tmp / f"gpu-check-{mib}.plan", SYNC_TENSORS, numel)


def sync_vram(args, state: dict) -> dict:
    variants: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        plan = _sync_plan(args, Path(tmp), args.mib)
        todo = [(f"nixl {name}", {"UCX_TLS": tls} if tls else {}, "off", tls or "default")
                for name, tls in (UCX_VARIANTS if args.device == "cuda" else UCX_VARIANTS[:1])]
        if args.device == "cuda":
            todo.append(("runtime cuda_ipc", {}, "auto", "default"))
        for name, env, device_ipc, tls in todo:
            left = args.deadline_at - time.monotonic()
            if left < 8:
                variants[name] = skipped("no time left in the part's deadline")
                continue
            variant_s = VARIANT_S * (CPU_SLACK if args.device == "cpu" else 1)
            out = run_sync(args, plan, f"sync_vram.{name.replace(' ', '_').replace(',', '+')}", min(variant_s, left),
                           sender_device=args.device, receiver_device=args.device, env=env, device_ipc=device_ipc)
            variants[name] = _variant(out, ucx_tls=tls, device_ipc=device_ipc)
    good = {n: v for n, v in variants.items() if v["status"] == "ok"}
    figures = {"variants": variants, "bytes": args.mib << 20}
    bad = [n for n, v in variants.items() if v["status"] == "failed"]
    hung = [n for n, v in variants.items() if v["status"] == "error" and "deadline" in v["reason"]]
    if bad or hung or not good:
        return failed(f"bytes differ in {bad}; killed at the deadline (a hang) in {hung}; ok in {sorted(good)}", **figures)
    best = max(good, key=lambda n: good[n]["best_gbytes_per_s"])
    state["sync_gbytes_per_s"] = good[best]["best_gbytes_per_s"]
    state["sync_seconds_per_byte"] = good[best]["slowest_steady_s"] / good[best]["bytes"]
    figures |= {"best_variant": best, "best_gbytes_per_s": state["sync_gbytes_per_s"]}
    errors = sorted(set(variants) - set(good) - {n for n, v in variants.items() if v["status"] == "skipped"})
    return ok(f"{args.device} to {args.device}: byte-equal in every variant that connected ({', '.join(sorted(good))})"
              + (f"; ended with an error: {errors}" if errors else ""), **figures)


def sync_host_sender(args, state: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        plan = _sync_plan(args, Path(tmp), args.mib)
        out = run_sync(args, plan, "sync_host_sender", args.deadline_at - time.monotonic() - 1, sender_device="cpu",
                       receiver_device=args.device)
    variant = _variant(out, ucx_tls="default")
    status, reason = variant.pop("status"), variant.pop("reason")
    if status != "ok":
        return failed(f"host to {args.device}: {reason}", **variant)
    state["host_sync_gbytes_per_s"] = variant["best_gbytes_per_s"]
    return ok(f"pinned host to {args.device}: {reason}", **variant)


def ordering_sync(args, state: dict) -> dict:
    if "sync_seconds_per_byte" not in state:
        return skipped("needs sync_vram's measured sync time (sync_vram did not pass in this run)")
    nbytes = ORDERING_MIB << 20
    predicted = state["sync_seconds_per_byte"] * nbytes
    cycles, seconds = sleep_cycles(predicted, _max_clock_hz())
    figures = {"bytes": nbytes, "predicted_sync_s": round(predicted, 5), "sleep_s": seconds, "sleep_cycles": cycles}
    per_run = (args.deadline_at - time.monotonic()) / 2
    if per_run < seconds + 10:
        return failed(f"{per_run:.0f} s left per run cannot hold a {seconds} s sleep", **figures)
    with tempfile.TemporaryDirectory() as tmp:
        plan = _sync_plan(args, Path(tmp), ORDERING_MIB)
        common = dict(sender_device="cuda", receiver_device="cuda", versions=2, late_writes=True, sleep=cycles)
        waited = run_sync(args, plan, "ordering_sync.waited", per_run, **common)
        control = run_sync(args, plan, "ordering_sync.control", per_run, no_device_wait=True, **common)
    figures["logs"] = waited["logs"] + control["logs"]
    if "error" in waited:
        return failed(f"with the device wait: {waited['error']}", **figures)
    if not all(r["equal"] for r in waited["versions"]):
        return failed("the receiver got bytes from before the trainer's kernels finished", **figures)
    if "error" not in control and all(r["equal"] for r in control["versions"]):
        return failed(f"without the device wait the receiver still got the new bytes although the trainer's kernel slept "
                      f"{seconds} s (20x the predicted sync): the check cannot catch an early read", **figures)
    return ok(f"late writes arrived whole with the device wait; without it the receiver read early (kernel slept "
              f"{seconds} s, 20x the sync time predicted from sync_vram)", **figures)


# ---- an fp8_per_block plan between processes ----------------------------------------------------------------------

def fp8_shards(plan, version: int) -> dict:
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


def fp8_destination(plan, rank: int, device) -> dict:
    return {e.name: torch.zeros(e.shape, dtype=getattr(torch, e.dtype), device=device) for e in plan.dests if rank in e.ranks}


def fp8_sender_worker(args) -> None:
    from weightplan.runtime import Rendezvous, Sender, load_plan
    from weightplan.runtime.transport import protocol

    plan = load_plan(args.plan)
    rendezvous = Rendezvous.connect(args.job, args.address, timeout=args.timeout)
    device = torch.device(args.sender_device)
    tensors = {name: t.to(device) for name, t in fp8_shards(plan, 1)[args.rank].items()}
    with Sender(plan, args.rank, tensors, rendezvous=rendezvous, timeout=args.timeout, fp8_path="device") as sender:
        rendezvous.wait([protocol.joined_key(k) for k in sender.readers], args.timeout, "the gpu check's receiver processes")
        for version in range(1, args.versions + 1):
            if version > 1:
                sender.release(version - 1)
                for name, t in fp8_shards(plan, version)[args.rank].items():
                    tensors[name].copy_(t)
            sender.publish(version)
        report = sender.release(args.versions)
    print(json.dumps({"acked": list(report.acked), "quantize_seconds": sender.quantize_seconds}), flush=True)


def fp8_receiver_worker(args) -> None:
    from weightplan.runtime import Receiver, Rendezvous, execute_local, load_plan

    plan = load_plan(args.plan)
    rendezvous = Rendezvous.connect(args.job, args.address, timeout=args.timeout)
    destination = fp8_destination(plan, args.rank, torch.device(args.receiver_device))
    rows = []
    with Receiver(plan, args.rank, destination, rendezvous=rendezvous, timeout=args.timeout, derived="caller",
                  fp8_path="device") as receiver:
        for version in range(1, args.versions + 1):
            report = receiver.sync(version)
            expected = {args.rank: fp8_destination(plan, args.rank, torch.device("cpu"))}
            execute_local(plan, fp8_shards(plan, version), expected)
            rows.append({"version": version, "seconds": report.seconds, "bytes": report.bytes,
                         "quantize_seconds": report.quantize_seconds,
                         "equal": {n: _digest(t) for n, t in destination.items()}
                         == {n: _digest(t) for n, t in expected[args.rank].items()}})
    print(json.dumps({"versions": rows}), flush=True)


def sync_fp8(args, state: dict) -> dict:
    from ucx_proto_info import transports

    from weightplan.runtime import Rendezvous, load_plan

    plan = load_plan(FP8_PLAN)
    rounding = plan.header.quant_layout.scale_rounding.value
    job = f"gpucheckfp8{os.getpid()}x{int(time.time() * 1000) % 10**9}"
    deadline = args.deadline_at - time.monotonic() - 1
    timeout = max(5.0, deadline - 5)
    rendezvous = Rendezvous.connect(job, "127.0.0.1:0", serve=True, timeout=timeout)
    common = [sys.executable, __file__, "--plan", str(FP8_PLAN), "--job", job, "--address", rendezvous.address,
              "--sender-device", args.device, "--receiver-device", args.device, "--versions", str(VERSIONS),
              "--timeout", str(timeout)]
    commands = {f"trainer {r}": common + ["--worker", "fp8-sender", "--rank", str(r)] for r in range(plan.header.src_ranks)}
    commands |= {f"inference {k}": common + ["--worker", "fp8-receiver", "--rank", str(k)] for k in range(plan.header.dst_ranks)}
    outs = run_workers(commands, Path(args.logs), "sync_fp8", deadline)
    figures = {"rounding": rounding, "transports": transports(outs["ucx_text"])["read"], "logs": outs["logs"]}
    if "error" in outs:
        return failed(outs["error"], **figures)
    receivers = [outs[f"inference {k}"]["versions"] for k in range(plan.header.dst_ranks)]
    figures |= {"trainers": plan.header.src_ranks, "receivers": plan.header.dst_ranks, "versions": VERSIONS,
                "bytes_per_version": sum(rows[-1]["bytes"] for rows in receivers),
                "worst_sync_s": round(max(r["seconds"] for rows in receivers for r in rows), 4)}
    bad = [(k, r["version"]) for k, rows in enumerate(receivers) for r in rows if not r["equal"]]
    where = f"{args.device} on both sides, fp8 work on the {'GPU' if args.device == 'cuda' else 'host through the GPU code path'}"
    if bad:
        return failed(f"{where}: digests differ from the host executor's at (inference rank, version) {bad}", **figures)
    if args.device == "cuda" and rounding != "cuda":
        return failed(f"the carried plan records the {rounding!r} rounding; the check wants the CUDA rule", **figures)
    return ok(f"{where}: every destination's SHA-256 equals the host executor's on {len(receivers)} inference ranks, "
              f"{VERSIONS} versions, {rounding} scale rounding", **figures)


CHECKS = {"fp8_quantizer": fp8_quantizer, "delta_rates": delta_rates, "ordering_device": ordering_device,
          "copies": copies, "sync_vram": sync_vram, "sync_host_sender": sync_host_sender,
          "ordering_sync": ordering_sync, "sync_fp8": sync_fp8}
GPU_ONLY = {"fp8_quantizer", "delta_rates", "ordering_device", "copies", "ordering_sync"}
NEEDS_NIXL = {"sync_vram", "sync_host_sender", "ordering_sync", "sync_fp8"}


# ---- the driver ---------------------------------------------------------------------------------------------------

def part_process(args) -> None:
    """Run one part in this process (the driver's child); print {"part": ..., "state": ...}."""
    state = json.loads(args.state)
    args.deadline_at = time.monotonic() + args.deadline
    try:
        part = CHECKS[args.part](args, state)
    except Exception as exc:  # noqa: BLE001 - a part that breaks is reported as failed, the others still run
        traceback.print_exc()
        part = failed(f"{type(exc).__name__}: {str(exc)[:200]}")
    print(json.dumps({"part": part, "state": state}), flush=True)


def run_part(args, name: str, state: dict, deadline: float) -> dict:
    """One part in a child process under `deadline` seconds; its result (a kill at the deadline is a failure)."""
    logs = Path(args.logs)
    command = [sys.executable, __file__, "--part", name, "--device", args.device, "--mib", str(args.mib),
               "--logs", str(logs), "--deadline", str(deadline - 3), "--state", json.dumps(state)]
    with (logs / f"{name}.stdout").open("w") as out, (logs / f"{name}.stderr").open("w") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return failed(f"did not end within its {deadline:.0f} s deadline: killed (logs {logs}/{name}.*)")
    lines = [line for line in (logs / f"{name}.stdout").read_text(errors="replace").splitlines() if line.startswith('{"part"')]
    if not lines:
        tail = (logs / f"{name}.stderr").read_text(errors="replace").strip().splitlines() or ["no output"]
        return failed(f"the part's process exited with {proc.returncode} and no result: {tail[-1][:300]}")
    result = json.loads(lines[-1])
    state.update(result["state"])
    return result["part"]


def targets(state: dict) -> dict:
    """Each target with the figures it compares; met is None where a figure is missing."""
    def ratio(a, b):
        return round(state[a] / state[b], 4) if state.get(a) and state.get(b) else None

    out = {}
    for name, (value, want) in {"sync_vram_vs_copy": (ratio("sync_gbytes_per_s", "copy_gbytes_per_s"), 0.5),
                                "host_sync_vs_pinned_h2d": (ratio("host_sync_gbytes_per_s", "pinned_h2d_gbytes_per_s"), 0.8),
                                "quantizer_gbytes_per_s": (state.get("quantizer_gbytes_per_s"), 1000.0)}.items():
        out[name] = {"value": value, "target": want, "met": None if value is None else value >= want}
    return out


def _apply_targets(parts: dict, goals: dict) -> None:
    """A part whose target was measured and missed fails, with the figures in its reason."""
    for part, goal in (("sync_vram", "sync_vram_vs_copy"), ("sync_host_sender", "host_sync_vs_pinned_h2d"),
                       ("fp8_quantizer", "quantizer_gbytes_per_s")):
        t = goals[goal]
        if part in parts and parts[part]["status"] == "ok" and t["met"] is False:
            parts[part] = {**parts[part], "status": "failed",
                           "reason": f"below target: {goal} {t['value']} < {t['target']}; {parts[part]['reason']}"}


def report(parts: dict, state: dict, environment: dict, logs: str | None, started: float) -> None:
    goals = targets(state)
    _apply_targets(parts, goals)
    for name in PARTS:
        if name in parts:
            print(f"{name}: {parts[name]['status']} ({parts[name]['reason']})", flush=True)
    line = {"parts": {p: parts[p] for p in PARTS if p in parts}, "targets": goals,
            **{k: state.get(k) for k in FIGURES}, "environment": environment, "logs": logs,
            "seconds": round(time.monotonic() - started, 1)}
    out = os.environ.get("OUT")
    if out and logs and Path(out).is_dir():  # the lent machine returns at most 8 files: the logs go as one archive
        with tarfile.open(Path(out) / "gpu-check-logs.tar.gz", "w:gz") as tar:
            tar.add(logs, arcname="gpu-check-logs")
        line["logs_archive"] = str(Path(out) / "gpu-check-logs.tar.gz")
        (Path(out) / "gpu-check.json").write_text(json.dumps(line, indent=1) + "\n")
    print(json.dumps(line), flush=True)
    sys.exit(1 if any(p["status"] == "failed" for p in parts.values()) else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--mib", type=int, default=2048, help="bytes the sync parts move per version, in MiB")
    parser.add_argument("--logs", default=None, help="folder for every worker's stdout and stderr (default .gpu/logs)")
    parser.add_argument("--part", choices=PARTS)
    parser.add_argument("--deadline", type=float, default=60.0)
    parser.add_argument("--state", default="{}")
    parser.add_argument("--worker", choices=tuple(WORKERS))
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--plan")
    parser.add_argument("--job")
    parser.add_argument("--address")
    parser.add_argument("--sender-device", default="cuda")
    parser.add_argument("--receiver-device", default="cuda")
    parser.add_argument("--versions", type=int, default=VERSIONS)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--device-ipc", default=None)
    parser.add_argument("--sleep-cycles", type=int, default=0)
    parser.add_argument("--late-writes", action="store_true")
    parser.add_argument("--no-device-wait", action="store_true")
    args = parser.parse_args()
    started = time.monotonic()
    if args.worker or args.part:
        missing = _import_torch()
        if missing:
            sys.exit(missing)
        _weightplan()
        if args.worker:
            WORKERS[args.worker](args)
        else:
            part_process(args)
        return
    wanted = [p for p in PARTS if p in {w.strip() for w in args.parts.split(",") if w.strip()}]
    unknown = {w.strip() for w in args.parts.split(",") if w.strip()} - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    environment = {"python": sys.version.split()[0], "executable": sys.executable}
    missing = _import_torch()
    if missing is None and args.device == "cuda" and not torch.cuda.is_available():
        missing = f"no CUDA device (torch {torch.__version__})"
    if missing:
        report({p: skipped(missing) for p in wanted}, {}, environment, None, started)
    bundle = use_bundle()
    nixl = nixl_module()
    environment |= {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                    "nixl": nixl, "bundle": bundle, "ucx_tls": os.environ.get("UCX_TLS", "default"),
                    "ucx_modules": ucx_modules_loadable(bundle["nixl_from"]) if args.device == "cuda" else None}
    print(f"torch {torch.__version__} on {environment['device']}, NIXL {nixl or 'not importable'}, bundle "
          f"{'used' if bundle['manifest'] else 'absent'}", flush=True)
    logs = Path(args.logs or BUNDLE / "logs")
    logs.mkdir(parents=True, exist_ok=True)
    args.logs = str(logs.resolve())
    parts: dict[str, dict] = {}
    state: dict = {}
    slack = CPU_SLACK if args.device == "cpu" else 1
    for name in wanted:
        left = TOTAL_S * slack - (time.monotonic() - started)
        if args.device == "cpu" and name in GPU_ONLY:
            parts[name] = skipped("needs a GPU (--device cpu runs the sync harness on host memory)")
        elif name in NEEDS_NIXL and nixl is None:
            parts[name] = skipped("NIXL not importable: run make gpu-bundle and carry .gpu (docs/operations.md, 'GPUs')")
        elif left < 10:
            parts[name] = failed(f"no time left of the {TOTAL_S} s the check may take")
        else:
            parts[name] = run_part(args, name, state, min(DEADLINES[name] * slack, left))
        print(f"{name}: {parts[name]['status']} ({parts[name]['reason'][:160]})", file=sys.stderr, flush=True)
    report(parts, state, environment, args.logs, started)


WORKERS = {"sender": sender_worker, "receiver": receiver_worker, "fp8-sender": fp8_sender_worker,
           "fp8-receiver": fp8_receiver_worker}

if __name__ == "__main__":
    main()
