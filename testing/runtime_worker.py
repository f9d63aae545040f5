"""A trainer or inference process for the multi-process runtime tests (real NIXL/UCX on loopback).

Run as `python -m weightplan.testing.runtime_worker trainer|inference ...`; prints one JSON line per version.
Weights of version v are a deterministic function of (seed, v), so every process can rebuild the
trainer's full tensors and vLLM's own load of them is the ground truth on the inference side (for
fp8_per_block plans: load_weights + process_weights_after_loading, vLLM's online quantization).
`--plan`, `--job` and `--model` may list several comma-separated cases, run one after the other by
every process whose rank the case has, so several plans share the cost of starting processes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import zlib

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import numpy as np
import torch

from weightplan.compiler.verify_plan import shard_sources
from weightplan.runtime import Receiver, Rendezvous, Sender, SyncError, execute_local, load_plan
from weightplan.runtime.tables.fanout import second_hops
from weightplan.runtime.tables.ranks import layout_rank
from weightplan.runtime.transport import protocol


def full_weights(plan, seed: int, version: int) -> dict[str, torch.Tensor]:
    """The trainer's full tensors at `version` (master dtype)."""
    out = {}
    for entry in plan.sources:
        g = torch.Generator().manual_seed(seed * 1_000_003 + version * 7919 + zlib.crc32(entry.name.encode()))
        out[entry.name] = torch.randn(entry.shape, generator=g).to(getattr(torch, entry.dtype))
    return out


def version_weights(plan, args, version: int) -> dict[str, torch.Tensor]:
    """The trainer's full tensors at `version`: full_weights, or with --sparse D the first version's weights changed in
    about D of their elements at every later version (an optimizer step whose bf16 casts mostly round to the same
    bytes), so delta syncs have something to leave out."""
    if not args.sparse:
        return full_weights(plan, args.seed, version)
    out = full_weights(plan, args.seed, args.versions[0])
    for step in args.versions[1 : args.versions.index(version) + 1]:
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        for name in sorted(out):
            flat = out[name].view(-1)
            hit = torch.rand(flat.numel(), generator=g) < args.sparse
            flat[hit] = torch.randn(int(hit.sum()), generator=g).to(flat.dtype)
    return out


def shard(plan, full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Trainer `rank`'s local shards of the full tensors, as the plan's trainer layout cuts them."""
    return shard_sources(plan, full, {rank})[rank]


_CASE = {}  # the job of the case being run, added to every event


def emit(**fields) -> None:
    print(json.dumps({**_CASE, **fields, "at": time.time()}), flush=True)


def plain_destination(plan, rank: int) -> dict[str, torch.Tensor]:
    return {e.name: torch.full(e.shape, float("nan")).to(getattr(torch, e.dtype)) for e in plan.dests if rank in e.ranks}


def host_reference(plan, full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """The in-process host executor's result: the reference for plain (non-vLLM) destinations."""
    out = {r: plain_destination(plan, r) for r in {rank, *second_hops(plan, rank)}}  # and its node's pullers (fan-out)
    execute_local(plan, {r: shard(plan, full, r) for r in range(plan.header.src_ranks)}, out)
    return out[rank]


def wait_gate(args, rendezvous, kind: str, version: int) -> None:
    """Wait for the test's `kind` gate of `version` (go, resume): a store key, or with --gate-dir a file (a test
    that does not reach the store, on an emulated cluster, shares the filesystem)."""
    if not args.gate_dir:
        rendezvous.wait([f"test/{kind}/{version}"], args.join_timeout, f"test {kind}")
        return
    flag, deadline = os.path.join(args.gate_dir, f"{kind}-{version}"), time.monotonic() + args.join_timeout
    while not os.path.exists(flag):
        if time.monotonic() > deadline:
            raise SystemExit(f"no test {kind} gate for version {version}")
        time.sleep(0.005)  # the readers of a benchmark start within a few ms of each other


def destination_digest(destination: dict[str, torch.Tensor]) -> str:
    """One SHA-256 over every destination tensor's bytes, in name order: equal digests, equal destinations."""
    digest = hashlib.sha256()
    for name in sorted(destination):
        digest.update(name.encode())
        digest.update(destination[name].reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def byte_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def run_trainer(args, plan) -> None:
    tensors = shard(plan, version_weights(plan, args, args.versions[0]), args.rank)
    rendezvous = Rendezvous.connect(args.job, args.address, timeout=args.timeout)
    sender = Sender(plan, args.rank, tensors, rendezvous=rendezvous, timeout=args.timeout, verify=args.digests,
                    ring_bytes=args.ring_bytes, progress=args.progress, delta=args.delta,
                    pool_ranks=args.pool_ranks).start()
    emit(event="ready", rank=args.rank)
    deadline = time.monotonic() + args.join_timeout
    plan_readers = [k for k in sender.readers if k < plan.header.dst_ranks]  # pool replicas are waited for once joined
    while args.wait_joined and not all(rendezvous.exists(protocol.joined_key(k)) for k in plan_readers):
        if time.monotonic() > deadline:
            raise SystemExit("inference ranks did not join")
        time.sleep(0.05)
    for version in args.versions:
        if args.gate:
            wait_gate(args, rendezvous, "go", version)
        if version != args.versions[0]:  # an optimizer step: new values in the same tensors
            for name, value in shard(plan, version_weights(plan, args, version), args.rank).items():
                tensors[name].copy_(value)
        began = time.monotonic()
        try:
            sender.publish(version)
            emit(event="published", rank=args.rank, version=version)
            if args.busy_after_publish:  # a training step between publish and release: the runtime is not polled
                busy_until = time.monotonic() + args.busy_after_publish
                while time.monotonic() < busy_until:
                    time.sleep(0.01)
            if version == args.versions[-1] and args.hold_last:  # idle, serving the last version (background poll)
                wait_gate(args, rendezvous, "release", version)
            report = sender.release(version)
        except SyncError as exc:  # e.g. the store unreachable: the trainer says so and goes on to the next version
            emit(event="failed", rank=args.rank, version=version, error=str(exc), seconds=time.monotonic() - began)
            continue
        emit(event="released", rank=args.rank, version=version, acked=list(report.acked), failed=list(report.failed),
             timed_out=list(report.timed_out), gatherers_timed_out=list(report.gatherers_timed_out), returned=list(report.returned),
             seconds=report.seconds,
             gather_seconds=sender.gather_seconds, quantize_seconds=sender.quantize_seconds,
             table_bytes=sender.stats.table_bytes, packed_bytes=sender.stats.packed_bytes, stored_runs=sender.stats.stored_runs)
    if args.linger:
        time.sleep(args.linger)


def wait_go_or_leave(args, rendezvous, version: int) -> bool:
    """With --leave-gate (and --gate-dir): wait for the go gate of `version` or the file leave-RANK; True to leave."""
    if not (args.leave_gate and args.gate_dir):
        wait_gate(args, rendezvous, "go", version)
        return False
    leave, go = (os.path.join(args.gate_dir, name) for name in (f"leave-{args.rank}", f"go-{version}"))
    deadline = time.monotonic() + args.join_timeout
    while not os.path.exists(go):
        if os.path.exists(leave):
            return True
        if time.monotonic() > deadline:
            raise SystemExit(f"no test go gate for version {version}")
        time.sleep(0.005)
    return False  # the go gate came first: this version is synced, the leave seen before the next


def run_plain_inference(args, plan) -> None:
    """An inference rank holding plain tensors; checked byte for byte against the host executor. With --pool-ranks, a
    rank beyond the plan's holds (and is checked against) the plan rank whose layout it copies."""
    plan_rank = layout_rank(plan, args.rank, args.pool_ranks)
    destination = plain_destination(plan, plan_rank)
    rendezvous = Rendezvous.connect(args.job, args.address, timeout=args.timeout)
    current = [0]

    def hold(names: list[str]) -> None:
        """With --hold-at v: stop after the first group of version v until the test says resume (it may kill someone)."""
        if current[0] == args.hold_at:
            current[0] = -1
            emit(event="mid-sync", rank=args.rank, version=args.hold_at, names=len(names))
            wait_gate(args, rendezvous, "resume", args.hold_at)

    if args.start_gate:
        emit(event="ready", rank=args.rank)
        wait_gate(args, rendezvous, "start", 0)
    eplb = plan.header.inference.eplb is not None
    if eplb:  # an EPLB engine: the table it serves with, written by the test or soak (testing/eplb.py)
        from .eplb import eplb_reference, latest_table, read_table

        table = latest_table(args.expert_maps, args.versions[0], plan)

    def make_receiver() -> Receiver:
        return Receiver(plan, args.rank, destination, rendezvous=rendezvous, timeout=args.timeout, verify=args.verify,
                        derived="caller",  # plain tensors: no modules whose derived state could go stale
                        group_bytes=args.group_bytes, post_op=hold, ring_bytes=args.ring_bytes, delta=args.delta,
                        device_ipc=args.device_ipc, pool_ranks=args.pool_ranks,
                        expert_map=table if eplb else None).start()

    receiver = make_receiver()
    emit(event="joined", rank=args.rank)
    for version in args.versions:
        if args.gate and wait_go_or_leave(args, rendezvous, version):  # the pool shrinks: this rank leaves
            receiver.close()
            emit(event="left", rank=args.rank, version=version, reported=receiver.version)
            return
        moved = read_table(args.expert_maps, version) if eplb else None
        if moved is not None and not np.array_equal(moved, table):  # the balancer moved experts: a Receiver on the new
            table = moved  # table, as the vLLM backend makes one (vllm_backend/engine.py Side.follow_experts)
            receiver.close()
            receiver = make_receiver()
            emit(event="experts-followed", rank=args.rank, version=version)
        current[0] = version
        began = time.monotonic()
        try:
            report = receiver.sync(version)
        except SyncError as exc:
            emit(event="failed", rank=args.rank, version=version, error=str(exc), reported=receiver.version,
                 seconds=time.monotonic() - began)
            continue
        full = version_weights(plan, args, version)
        expected = eplb_reference(plan, full, plan_rank, table) if eplb else host_reference(plan, full, plan_rank)
        differ = sorted(n for n, t in expected.items() if not byte_equal(t, destination[n]))
        emit(event="synced", rank=args.rank, version=version, reported=receiver.version, tensors=len(expected),
             differ=differ[:5], n_differ=len(differ), bytes=report.bytes, descriptors=report.descriptors,
             groups=report.groups, seconds=report.seconds, verify_seconds=report.verify_seconds,
             second_hop_bytes=report.second_hop_bytes, slowest_trainer=report.slowest_trainer,
             slowest_share=report.slowest_share, took=report.took, delta_bytes=report.delta_bytes, paths=report.paths,
             sha256=destination_digest(destination))
    receiver.close()  # with fan-out, after this node's peers finished reading its last version


def run_inference(args, plan) -> None:
    if args.plain:
        return run_plain_inference(args, plan)
    if plan.header.quant != "none":
        return run_quantized_inference(args, plan)
    from weightplan.compiler.frontend.vllm_compat import compute_tensor_digests, is_deferred_attention_layer
    from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config
    from weightplan.compiler.frontend.vllm_patches import parallel_rank
    from weightplan.compiler.verify_plan import plan_conversion

    info = plan.header.inference
    at = info.rank_coords(args.rank)

    def model_for_rank():  # this rank's model as vLLM's loader builds it (a pipeline rank: its stage only)
        base = make_vllm_config(args.model)
        config = make_vllm_config(args.model, tp=info.tp, dp=info.dp, ep=info.ep, pp=info.pp or 1) if plan.header.dst_ranks > 1 else base
        return config, build_model(config, "cpu", tp_rank=at.tp, dp_rank=at.dp, pp_rank=at.pp, base_config=base)

    _, model = model_for_rank()
    for param in model.parameters():
        param.data.fill_(float("nan") if param.dtype.is_floating_point else 0)
    rendezvous = Rendezvous.connect(args.job, args.address, timeout=args.timeout)
    receiver = Receiver(plan, args.rank, model, rendezvous=rendezvous, timeout=args.timeout, verify=args.verify,
                        group_bytes=args.group_bytes, ring_bytes=args.ring_bytes, device_ipc=args.device_ipc).start()
    emit(event="joined", rank=args.rank)
    ref_config, reference = model_for_rank()
    conversion = plan_conversion(ref_config, plan)

    def digests(version):
        full = full_weights(plan, args.seed, version)
        with torch.no_grad(), parallel_rank(ref_config, at.tp, at.dp, at.pp):
            reference.load_weights(conversion(full.items()))
            # vLLM's reload finishes attention layers this way (reload/layerwise.py:_finalize_attention_layer):
            # MLA absorbs kv_b_proj into W_UK_T/W_UV, which the receiver must recompute after every sync.
            for module in reference.modules():
                if is_deferred_attention_layer(module):
                    module.process_weights_after_loading(torch.bfloat16)
        return compute_tensor_digests(reference), compute_tensor_digests(model)

    sync_versions(args, receiver, digests)
    receiver.close()


def sync_versions(args, receiver, digests, extra=lambda report: {}) -> None:
    """Sync every requested version; emit `failed`, or `synced` with the names whose digests differ.

    `digests(version)` gives (vLLM's own digests for that version's weights, the receiver's digests).
    """
    for version in args.versions:
        try:
            report = receiver.sync(version)
        except SyncError as exc:
            emit(event="failed", rank=args.rank, version=version, error=str(exc), reported=receiver.version)
            continue
        expected, actual = digests(version)
        differ = sorted(n for n in expected if expected[n] != actual.get(n))
        absorbed = sum(n.endswith((".W_UV", ".W_UK_T")) for n in expected)  # MLA state derived after loading
        emit(event="synced", rank=args.rank, version=version, reported=receiver.version, digests=len(expected), absorbed=absorbed,
             differ=differ[:5], n_differ=len(differ), bytes=report.bytes, descriptors=report.descriptors,
             groups=report.groups, seconds=report.seconds, verify_seconds=report.verify_seconds,
             table_bytes=report.table_bytes, packed_bytes=report.packed_bytes,
             stored_runs=sum(len(r) for r in receiver.reads.values()), second_hop_bytes=report.second_hop_bytes,
             slowest_trainer=report.slowest_trainer, slowest_share=report.slowest_share,
             **extra(report))


def run_quantized_inference(args, plan) -> None:
    """An inference rank holding a vLLM model after online fp8 quantization; checked against vLLM's own quantized load."""
    from weightplan.compiler.digests import tensor_digests
    from weightplan.compiler.frontend.vllm_model import make_vllm_config
    from weightplan.compiler.verify_plan import vllm_load_quantized

    # The reference quantizes eagerly (vllm_patches.eager_block_quantization); nothing else here needs torch.compile,
    # whose first compile costs ~35 s per process.
    torch._dynamo.config.disable = True
    info, quant = plan.header.inference, plan.header.quant
    at = info.rank_coords(args.rank)
    base = make_vllm_config(args.model, quantization=quant)
    config = make_vllm_config(args.model, tp=info.tp, dp=info.dp, ep=info.ep, pp=info.pp or 1, quantization=quant) \
        if plan.header.dst_ranks > 1 else base

    def vllm_quantized(full):
        return vllm_load_quantized(config, base, plan, full, None, at.tp, at.dp, pp_rank=at.pp)

    # Every parameter of the processed model, poisoned (0x7f bytes) so anything the sync misses shows.
    params = vllm_quantized({e.name: torch.zeros(e.shape, dtype=getattr(torch, e.dtype)) for e in plan.sources})
    for param in params.values():
        param.data.view(-1).view(torch.uint8).fill_(0x7F)
    rendezvous = Rendezvous.connect(args.job, args.address, timeout=args.timeout)
    # fp8 MLA layers cannot be processed on CPU with the Triton stub: derived state is not recomputed here.
    receiver = Receiver(plan, args.rank, params, rendezvous=rendezvous, timeout=args.timeout, verify=args.verify,
                        derived="caller", group_bytes=args.group_bytes, ring_bytes=args.ring_bytes,
                        device_ipc=args.device_ipc).start()
    emit(event="joined", rank=args.rank)
    sync_versions(
        args, receiver,
        lambda version: (tensor_digests(vllm_quantized(full_weights(plan, args.seed, version))),
                         tensor_digests(params)),
        lambda report: dict(quantize_seconds=report.quantize_seconds, staging_bytes=receiver.stats.staging_bytes,
                            fp8=sum(t.dtype == torch.float8_e4m3fn for t in params.values())),
    )
    receiver.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("trainer", "inference"))
    parser.add_argument("--plan", required=True, help="plan file; several comma-separated run one after another")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--job", required=True, help="job id; comma-separated, one per --plan")
    parser.add_argument("--versions", type=lambda s: [int(v) for v in s.split(",")], default=[1])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--model", help="config directory (inference); comma-separated, one per --plan")
    parser.add_argument("--digests", action="store_true", help="trainer publishes per-region digests")
    parser.add_argument("--verify", action="store_true", help="receiver checks digests every sync")
    parser.add_argument("--wait-joined", action="store_true", help="trainer waits for its readers (the plan's ranks) before publishing")
    parser.add_argument("--join-timeout", type=float, default=300.0)
    parser.add_argument("--plain", action="store_true", help="inference rank holds plain tensors, not a vLLM model")
    parser.add_argument("--gate", action="store_true", help="publish (trainer) or sync (inference) version v once the key test/go/v exists")
    parser.add_argument("--gate-dir", help="with --gate/--hold-at: wait for files go-v/resume-v here, not store keys")
    parser.add_argument("--start-gate", action="store_true",
                        help="plain inference: connected to the store, wait for test/start/0 before starting its Receiver")
    parser.add_argument("--hold-at", type=int, default=-1, help="inference pauses mid-sync of this version until test/resume/v")
    parser.add_argument("--group-bytes", type=int, default=256 << 20)
    parser.add_argument("--ring-bytes", type=int, default=512 << 20, help="Sender/Receiver ring_bytes (bounded packed region)")
    parser.add_argument("--busy-after-publish", type=float, default=0.0,
                        help="trainer sleeps this long between publish and release, never polling the runtime")
    parser.add_argument("--progress", default="auto", help="trainer's target-side progress (runtime/transport/progress.py)")
    parser.add_argument("--delta", type=float, default=0.0, help="Sender/Receiver delta (fraction held for deltas; 0: off)")
    parser.add_argument("--sparse", type=float, default=0.0, help="each later version changes about this fraction of elements")
    parser.add_argument("--device-ipc", default="auto", help="Receiver device_ipc: auto (same-host reads direct) or off; comma-separated, one per --plan")
    parser.add_argument("--linger", type=float, default=0.0, help="trainer stays alive this long after the last version")
    parser.add_argument("--pool-ranks", type=int, default=None,
                        help="Sender/Receiver pool_ranks: DP replicas beyond the plan's ranks (plain inference)")
    parser.add_argument("--leave-gate", action="store_true",
                        help="plain inference with --gate-dir: close the Receiver and exit when the file leave-RANK exists")
    parser.add_argument("--expert-maps", default=".",
                        help="plain inference of an EPLB plan: the directory of expert-map-V.json tables (testing/eplb.py)")
    parser.add_argument("--hold-last", action="store_true",
                        help="trainer stays idle holding its last version until test/release/v, then releases it")
    args = parser.parse_args(argv)
    plans, jobs = args.plan.split(","), args.job.split(",")
    models = args.model.split(",") if args.model else [None] * len(plans)
    ipcs = args.device_ipc.split(",") if "," in args.device_ipc else [args.device_ipc] * len(plans)
    if not len(plans) == len(jobs) == len(models) == len(ipcs):
        raise SystemExit("--plan, --job, --model and --device-ipc must list the same number of cases")
    for path, job, model, ipc in zip(plans, jobs, models, ipcs):
        _CASE["job"] = job
        plan = load_plan(path)
        ranks = plan.header.src_ranks if args.role == "trainer" else max(plan.header.dst_ranks, args.pool_ranks or 0)
        if args.rank < ranks:
            (run_trainer if args.role == "trainer" else run_inference)(argparse.Namespace(**{
                **vars(args), "plan": path, "job": job, "model": model, "device_ipc": ipc}), plan)
            emit(event="case-done", rank=args.rank)


if __name__ == "__main__":
    sys.exit(main())
