"""One process of `make bench-runtime`: a trainer or an inference rank, running the measured rounds in lockstep.

Rounds per repetition (separated by gloo barriers over all processes):
  ceiling  - inference ranks process_vm_readv every descriptor's bytes from the trainer processes' unpacked regions
  sync     - trainers publish, inference ranks sync (weightplan over NIXL/UCX), trainers release
  baseline - trainers all-gather shards, trainer 0 broadcasts full tensors (gloo), inference ranks load_weights
Each process prints one JSON line per round with wall-clock start/end, so the driver can take
max(end) - min(start) across processes. With an fp8_per_block plan only the sync round runs, into
plain tensors shaped like vLLM's quantized parameters, and at the end each inference rank compares
its digests with vLLM's own quantized load (load_weights + process_weights_after_loading) of the
same trainer weights.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from datetime import timedelta

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import numpy as np
import torch
import torch.distributed as dist

from weightplan.runtime import Receiver, Rendezvous, Sender, load_plan
from weightplan.runtime.casts import cast_along
from weightplan.runtime.tables.ranks import reads_of, row_pieces, served_regions
from weightplan.runtime.transport import protocol

_LIBC = ctypes.CDLL(None, use_errno=True)
IOV_MAX = 1024


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def trainer_shards(plan, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """This rank's shard of deterministic random full tensors (generated per shard, never whole)."""
    return {entry.name: _shard(plan, i, rank, seed) for i, entry in enumerate(plan.sources)}


def _shard(plan, source: int, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + source * 7919 + rank)
    return torch.randn(plan.local_shape(source, rank), generator=g).to(getattr(torch, plan.sources[source].dtype))


class _FullTensors:
    """The trainers' full tensors, assembled from their shards one source at a time when asked for."""

    def __init__(self, plan, seed: int):
        self.plan, self.seed = plan, seed
        self.index = {e.name: i for i, e in enumerate(plan.sources)}

    def get(self, name: str):
        i = self.index[name]
        entry = self.plan.sources[i]
        full = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
        for rank in range(self.plan.header.src_ranks):
            box = self.plan.shard_box(i, rank)
            if box is not None and all(b > a for a, b in box):
                full[tuple(slice(a, b) for a, b in box)] = _shard(self.plan, i, rank, self.seed)
        return full


def quantized_reference_digests(plan, model: str, rank: int, seed: int) -> dict[str, str]:
    """Digests of vLLM's own online fp8 quantization of the trainers' weights on inference `rank`."""
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    from weightplan.compiler.frontend.vllm_model import make_vllm_config
    from weightplan.compiler.verify_plan import vllm_load_quantized

    torch._dynamo.config.disable = True  # vLLM torch.compiles its quantizer per shape (tens of s); eager is the same math
    info, quant = plan.header.inference, plan.header.quant
    base = make_vllm_config(model, quantization=quant)
    config = make_vllm_config(model, tp=info.tp, dp=info.dp, ep=info.ep, quantization=quant)
    params = vllm_load_quantized(config, base, plan, _FullTensors(plan, seed), None, rank % info.tp, rank // info.tp)
    return compute_tensor_digests(_Params(params))


class _Params:
    def __init__(self, params):
        self.params = params

    def named_parameters(self):
        return iter(self.params.items())


def unpacked_regions(plan, rank: int, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every region trainer `rank` serves, as a sender without packing would expose it: its own flat shard where the
    wire dtype is the shard's, else the shard cast along the region's chain (the staging copy such a sender writes).
    The Sender publishes address 0 for cast regions it serves only through its packed region, so the ceiling reads these."""
    out = []
    for region in served_regions(plan, rank):
        flat = tensors[plan.sources[region.source].name].reshape(-1)
        out.append(cast_along(flat, plan.cast_chains[region.chain]).contiguous() if region.staged else flat)
    return out


def read_ceiling(plan, rank: int, rendezvous: Rendezvous, destination: dict[str, torch.Tensor]) -> int:
    """process_vm_readv of exactly the bytes this rank's reads move, from the trainers' unpacked regions into the same
    destinations: one iovec per row of a strided run (per run where its rows are contiguous on both sides)."""
    total = 0
    for src, reads in reads_of(plan, rank).items():
        pid = int(rendezvous.get_bytes(f"bench/pid/{src}"))
        region = np.array(rendezvous.get_json(f"bench/regions/{src}")["addresses"], dtype=np.int64)[reads.region]
        base = np.array([destination[plan.dests[d].name].data_ptr() for d in reads.dest.tolist()], dtype=np.int64)
        _, size, (addr, dst) = row_pieces(reads.count, reads.nbytes, reads.contiguous(),
                                          (region + reads.src_byte, reads.src_stride), (base + reads.dst_byte, reads.dst_stride))
        for lo in range(0, len(size), IOV_MAX):
            total += _readv(pid, dst[lo : lo + IOV_MAX], addr[lo : lo + IOV_MAX], size[lo : lo + IOV_MAX])
    return total


def _readv(pid: int, local: np.ndarray, remote: np.ndarray, size: np.ndarray) -> int:
    """process_vm_readv of remote[i] -> local[i], size[i] bytes each, continuing after short reads; returns the bytes read.
    Raises OSError naming the pid, remote address and byte counts when the kernel reads nothing more."""
    local, remote, size = local.astype(np.uint64), remote.astype(np.uint64), size.astype(np.uint64)
    want, done = int(size.sum()), 0
    while done < want:
        iov_local, iov_remote = np.stack([local, size], axis=1), np.stack([remote, size], axis=1)
        got = _LIBC.process_vm_readv(pid, ctypes.c_void_p(iov_local.ctypes.data), len(size),
                                     ctypes.c_void_p(iov_remote.ctypes.data), len(size), 0)
        if got <= 0:
            errno = ctypes.get_errno() if got < 0 else 0
            raise OSError(errno, f"process_vm_readv from pid {pid} at remote address {int(remote[0]):#x}: read "
                                 f"{done} of {want} bytes, then {os.strerror(errno) if errno else 'nothing'}")
        done += got
        # Skip the iovecs read whole, and the read part of the first one read partly.
        ends = np.cumsum(size)
        first = int(np.searchsorted(ends, got, side="right"))
        local, remote, size = local[first:], remote[first:], size[first:]
        if len(size):
            part = np.uint64(got - (int(ends[first - 1]) if first else 0))
            local[0] += part
            remote[0] += part
            size[0] -= part
    return done


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("trainer", "inference"))
    parser.add_argument("--plan", required=True)
    parser.add_argument("--model", help="config directory (inference with a vLLM model)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--gloo", action="store_true", help="run the gloo baseline, with barriers between rounds")
    parser.add_argument("--job", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--verify", action="store_true", help="receivers check digests (trainers publish them)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--no-baseline", action="store_true", help="with --gloo, only the ceiling and sync rounds")
    parser.add_argument("--ring-bytes", type=int, default=512 << 20, help="Sender/Receiver ring_bytes")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = load_plan(args.plan)
    quantized = plan.header.quant != "none"
    n_src = plan.header.src_ranks
    rendezvous = Rendezvous.connect(args.job, args.address, timeout=600)
    world_rank = args.rank if args.role == "trainer" else n_src + args.rank
    world = n_src + plan.header.dst_ranks
    # Standalone gloo groups on the job's store: vLLM owns this process's default torch.distributed world.
    groups, barrier = (None, None), (lambda: None)
    if args.gloo:
        world_group = _gloo(rendezvous, "world", world_rank, world)
        barrier = lambda: world_group.barrier().wait()  # noqa: E731
        trainers = _gloo(rendezvous, "trainers", args.rank, n_src) if args.role == "trainer" else None
        member = args.role == "inference" or args.rank == 0
        bcast = _gloo(rendezvous, "bcast", 0 if args.role == "trainer" else 1 + args.rank, 1 + plan.header.dst_ranks) if member else None
        groups = (trainers, bcast)

    if args.role == "trainer":
        tensors = trainer_shards(plan, args.rank, seed=1)
        rendezvous.put(f"bench/pid/{args.rank}", str(os.getpid()).encode())
        sender = Sender(plan, args.rank, tensors, rendezvous=rendezvous, timeout=120, verify=args.verify,
                        ring_bytes=args.ring_bytes).start()
        if not quantized:  # what the copy ceiling reads; kept alive until this process exits
            ceiling_regions = unpacked_regions(plan, args.rank, tensors)
            rendezvous.put(f"bench/regions/{args.rank}", {"addresses": [t.data_ptr() for t in ceiling_regions]})
        model = None
    else:
        if args.model and not quantized:
            from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config

            info = plan.header.inference
            base = make_vllm_config(args.model)
            config = make_vllm_config(args.model, tp=info.tp, dp=info.dp, ep=info.ep)
            tp_rank, dp_rank = args.rank % info.tp, args.rank // info.tp
            model = build_model(config, "cpu", tp_rank=tp_rank, dp_rank=dp_rank, base_config=base)
            destination = dict(model.named_parameters())
        else:
            model = None
            destination = {e.name: torch.zeros(e.shape, dtype=getattr(torch, e.dtype)) for e in plan.dests if args.rank in e.ranks}
        # A vLLM model gets its derived MLA state recomputed after every sync; plain tensors have none to recompute.
        receiver = Receiver(plan, args.rank, model if model is not None else destination, rendezvous=rendezvous,
                            timeout=120, verify=args.verify, derived="refresh" if model is not None else "caller",
                            ring_bytes=args.ring_bytes).start()
        stats = receiver.stats
        emit(event="joined", rank=args.rank, bytes=stats.bytes, descriptors=stats.descriptors,
             destination_bytes=stats.destination_bytes, staging_bytes=stats.staging_bytes)
    rendezvous.put(f"bench/ready/{args.role}/{args.rank}", b"1")
    if not args.gloo:
        rendezvous.wait(["bench/start"], 600, "driver start")

    for rep in range(1, args.repeats + 1):
        if not quantized:  # the copy ceiling reads the runs' bytes; fp8 plans also read fp8, scales and staging
            barrier()
            start = time.time()
            moved = read_ceiling(plan, args.rank, rendezvous, destination) if args.role == "inference" else 0
            end = time.time()
            barrier()
            emit(round="ceiling", rep=rep, role=args.role, rank=args.rank, start=start, end=end, bytes=moved)
        # sync (gated by the driver when there are no barriers)
        barrier()
        start, cpu = time.time(), time.process_time()  # process CPU time: every thread, NIXL's included
        if args.role == "trainer":
            sender.publish(rep)
            published, publish_cpu = time.time(), time.process_time() - cpu
            report = sender.release(rep)
            end = time.time()
            emit(round="sync", rep=rep, role="trainer", rank=args.rank, start=start, end=end, published=published,
                 cpu_seconds=time.process_time() - cpu, publish_cpu_seconds=publish_cpu,
                 acked=list(report.acked), digest_seconds=sender.digest_seconds, staging_bytes=sender.staging_bytes,
                 quantize_seconds=sender.quantize_seconds, gather_seconds=sender.gather_seconds,
                 gather_wait_seconds=sender._gather.wait_seconds if sender._gather else 0.0,
                 table_bytes=sender.stats.table_bytes, packed_bytes=sender.stats.packed_bytes)
        else:
            if not args.gloo:  # measure the sync alone, not the wait for the trainer to publish
                rendezvous.wait([protocol.version_key(src, rep) for src in receiver.reads], 600, "publication")
            cpu = time.process_time()
            report = receiver.sync(rep)
            end = time.time()
            emit(round="sync", rep=rep, role="inference", rank=args.rank, start=end - report.seconds, end=end,
                 cpu_seconds=time.process_time() - cpu,
                 bytes=report.bytes, descriptors=report.descriptors, seconds=report.seconds,
                 verify_seconds=report.verify_seconds, quantize_seconds=report.quantize_seconds,
                 derived_seconds=report.derived_seconds, destination_bytes=receiver.stats.destination_bytes,
                 table_bytes=report.table_bytes, packed_bytes=report.packed_bytes)
            if model is not None and rep == args.repeats:
                from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

                synced_digests = compute_tensor_digests(model)
        barrier()
        if not args.gloo or quantized or args.no_baseline:
            continue
        # baseline: all-gather shards, broadcast full tensors from trainer 0, vLLM load_weights
        barrier()
        start = time.time()
        comm = _baseline(plan, args, tensors if args.role == "trainer" else None, groups, model, n_src)
        end = time.time()
        barrier()
        emit(round="baseline", rep=rep, role=args.role, rank=args.rank, start=start, end=end, comm_s=comm)
    if args.role == "inference" and quantized and args.model:
        synced = {name: d for name, d in _digests(destination).items()}
        expected = quantized_reference_digests(plan, args.model, args.rank, seed=1)
        emit(event="identical", rank=args.rank, value=synced == expected, tensors=len(expected),
             differ=sorted(n for n in expected if expected[n] != synced.get(n))[:5])
    if args.role == "inference" and model is not None and args.gloo:
        from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

        loaded = compute_tensor_digests(model)
        emit(event="identical", rank=args.rank, value=loaded == synced_digests, tensors=len(loaded))
    barrier()


def _baseline(plan, args, shards, groups, model, n_src: int) -> float:
    """The usual way: gather each full tensor on trainer 0, broadcast it to every inference rank, which streams it
    into load_weights. Returns the seconds this process spent inside gloo collectives."""
    trainers, bcast = groups
    comm = [0.0]

    def timed_broadcast(group, tensor, root):
        began = time.perf_counter()
        _broadcast(group, tensor, root)
        comm[0] += time.perf_counter() - began

    def receive():
        for entry in plan.sources:
            full = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
            timed_broadcast(bcast, full, 0)
            yield entry.name, full

    if args.role == "inference":
        from weightplan.compiler.frontend.vllm_model import make_vllm_config
        from weightplan.compiler.frontend.vllm_patches import parallel_rank

        info = plan.header.inference
        config = make_vllm_config(args.model, tp=info.tp, dp=info.dp, ep=info.ep)
        with torch.no_grad(), parallel_rank(config, args.rank % info.tp, args.rank // info.tp):
            model.load_weights(receive())
        return comm[0]
    for i, entry in enumerate(plan.sources):
        boxes = [plan.shard_box(i, r) for r in range(n_src)]
        parts = [torch.empty(plan.local_shape(i, r), dtype=getattr(torch, entry.dtype)) for r in range(n_src)]
        for r, part in enumerate(parts):  # torch.chunk shards differ in size: one broadcast per shard
            if r == args.rank:
                part.copy_(shards[entry.name])
            if part.numel():
                timed_broadcast(trainers, part, r)
        if args.rank == 0:
            full = torch.empty(entry.shape, dtype=parts[0].dtype)
            for box, part in zip(boxes, parts):
                if box is not None and part.numel():
                    full[tuple(slice(a, b) for a, b in box)] = part.view([b - a for a, b in box])
            timed_broadcast(bcast, full, 0)
    return comm[0]


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    return compute_tensor_digests(_Params(tensors))


def _gloo(rendezvous: Rendezvous, name: str, rank: int, size: int):
    store = dist.PrefixStore(f"weightplan/{rendezvous.job}/gloo/{name}", rendezvous.store)
    return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=600))


def _broadcast(group, tensor: torch.Tensor, root: int) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    group.broadcast([tensor], opts).wait()


if __name__ == "__main__":
    sys.exit(main())
