"""Benchmark: delta syncs against full syncs of the same steps, from live FSDP2 trainers training with AdamW.

Usage: python benchmarks/bench_delta.py [--layers N] [--steps N] [--lrs 1e-6,1e-5] [--quants none,fp8_per_block] [--smoke]
       python benchmarks/bench_delta.py --encodings     (make bench-delta runs both)

Per case (an lr, a quantization): this process is the inference side; it starts `--trainers` (4) trainer processes
(this file with `--role trainer`) that build transformers' DeepseekV3ForCausalLM for benchmarks/configs/
bench-deepseek-v3 cut to `--layers` decoder layers (all 9: the 1.03 GB model), shard it with FSDP2 over gloo on a
(dp_shard, ep) = (2, 2) mesh as testing/moe_trainer.py does, fp32 masters computing in bf16 (bf16 on the wire), and
train the toy objective with AdamW at the case's lr. The plan is compiled for their live layout and two inference
ranks holding every weight (`dp=2`): rank 0 takes deltas (`Receiver(delta=0.5)`, verify=True), rank 1 always takes
full syncs; both are plain tensors in this process. Every trainer `LiveSender(delta=0.5, verify=True)`.

Version 1 (the initial weights) is a full sync for both. Then per step: one optimizer step on every trainer,
`publish(v)`; rank 1 syncs v (full), then rank 0 (delta). Figures per case (medians over the steps):
  density          the changed fraction of the diffed wire units, over every trainer (Sender.delta_stats)
  delta_wire_ratio rank 0's bytes READ (delta indexes and blobs, plus anything read full) / rank 1's
  delta_sync_s, full_sync_s  each rank's Receiver.sync seconds, rank 0's without its verification (verify_s)
  identical        every step, rank 0's verify=True check passed (the digests of every entry it holds after a chain of
                   deltas equal the trainers' digests of a full sync), and the entries both ranks hold (all but the
                   experts, which vLLM shards over the dp ranks; `compared_fraction` of the bytes) are byte for byte
                   equal to rank 1's, which took every version full
  sender_extra_bytes the largest trainer's delta memory (previous pages, delta region, index: Sender.delta_extra_bytes)
  delta_took       how many of rank 0's syncs took the delta (a step whose delta exceeds the region is sent full)
--encodings: bytes of each page encoding against density on random bf16 pages, and encode/decode throughput.
--smoke: testing/configs/tiny-deepseek-v3, 2 trainers, ep 1, 2 steps, lr 1e-5, both quantizations; it checks that
everything runs and the keys are there (tests/e2e/test_benchmark_smoke.py), not the figures. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
ROOT = Path(__file__).resolve().parent.parent

import numpy as np  # noqa: E402
import torch  # noqa: E402

from weightplan.testing import moe_trainer as mt  # noqa: E402
from weightplan.runtime import LiveSender, Receiver, Rendezvous, load_plan, write_trainer_layout  # noqa: E402
from weightplan.runtime.delta.encode import Encoding, changed, decode, encode, encoded_sizes  # noqa: E402
from weightplan.runtime.transport import protocol  # noqa: E402

CONFIG = ROOT / "benchmarks" / "configs" / "bench-deepseek-v3"
SMOKE = ["--config", str(mt.CONFIG), "--layers", "0", "--trainers", "2", "--ep", "1", "--steps", "2", "--lrs", "1e-5"]
DELTA = 0.5  # the fraction of the served pages the trainers' delta region (and the receiver's staging) holds


def run_trainer(args) -> None:
    rendezvous = Rendezvous.connect(args.job, args.address, timeout=args.timeout)
    mt.init_trainer_group(args.rank, args.trainers, rendezvous)
    model = mt.build_model(Path(args.config), torch.float32)
    mt.parallelize(model, ep=args.ep, param_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.rank == 0:
        write_trainer_layout(model, Path(args.workdir) / "trainer-layout.json")
        rendezvous.put("bench/layout", b"1")
    rendezvous.wait(["bench/plan"], args.timeout * 4, "the plan from the inference side")
    plan = load_plan(rendezvous.get_bytes("bench/plan").decode())
    sender = LiveSender(plan, args.rank, model, rendezvous=rendezvous, timeout=args.timeout, verify=True, delta=DELTA).start()
    for version in range(1, args.steps + 2):
        if version > 1:
            mt.train_steps(model, optimizer, 1)
        sender.publish(version)
        stats = sender.delta_stats
        if version == 1:
            rendezvous.put(f"bench/info/{args.rank}", {"extra_bytes": sender.delta_extra_bytes, "page_bytes": stats.page_bytes})
        rendezvous.put(f"bench/stats/{version}/{args.rank}", {"changed": stats.changed_units, "units": stats.units,
                                                               "delta_bytes": stats.delta_bytes, "seconds": stats.seconds,
                                                               "encodings": stats.encodings, "overflow": stats.overflow})
        sender.release(version)
    sender.close()


def _destination(plan, rank: int) -> dict[str, torch.Tensor]:
    return {e.name: torch.full(e.shape, float("nan")).to(getattr(torch, e.dtype)) for e in plan.dests if rank in e.ranks}


def run_case(args, config: Path, lr: float, quant: str) -> dict:
    from weightplan.compiler.compile import CompileOptions, compile_plan

    began = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="weightplan-bench-delta-"))
    job = f"{args.job}-{quant}-{lr:g}".replace("+", "").replace(".", "_")
    trainers = mt.TrainerProcesses(job, workdir, args.timeout)
    rendezvous, wait = trainers.rendezvous, trainers.wait
    try:
        trainers.start(__file__, args.trainers, "--job", job, "--workdir", str(workdir), "--trainers", str(args.trainers),
                       "--ep", str(args.ep), "--steps", str(args.steps), "--config", str(config), "--lr", repr(lr),
                       "--timeout", str(args.timeout))
        wait(["bench/layout"], "trainer layout", args.timeout * 4)
        plan_path = workdir / "bench-delta.plan"
        compile_plan(CompileOptions(str(config), trainer_format="stacked", trainer_dtype="fp32", quant=quant,
                                    inference="dp=2", trainer_layout=workdir / "trainer-layout.json", output=plan_path))
        plan = load_plan(plan_path)
        destinations = [_destination(plan, k) for k in (0, 1)]
        shared = [d for d, e in enumerate(plan.dests) if {0, 1} <= set(e.ranks)]
        shared_fraction = sum(plan.dests[d].nbytes for d in shared) / sum(t.numel() * t.element_size()
                                                                            for t in destinations[0].values())
        delta_rx = Receiver(plan, 0, destinations[0], rendezvous=rendezvous, timeout=args.timeout, derived="caller",
                            verify=True, delta=DELTA).start()
        full_rx = Receiver(plan, 1, destinations[1], rendezvous=Rendezvous.connect(job, rendezvous.address),
                           timeout=args.timeout, derived="caller").start()
        rendezvous.put("bench/plan", str(plan_path).encode())
        wait([f"bench/info/{r}" for r in range(args.trainers)], "trainer info")
        info = [rendezvous.get_json(f"bench/info/{r}") for r in range(args.trainers)]
        rows, identical = [], True
        for version in range(1, args.steps + 2):
            wait([protocol.version_key(r, version) for r in range(args.trainers)], f"version {version}", args.timeout * 4)
            full = full_rx.sync(version)
            delta = delta_rx.sync(version)
            # Entries both ranks hold are the same bytes (with dp=2 vLLM shards experts over the dp ranks, so those are
            # entries of one rank each): compared byte for byte; rank 0's verify=True covers every entry.
            differ = [plan.dests[d].name for d in shared
                      if not torch.equal(destinations[0][plan.dests[d].name].view(-1).view(torch.uint8),
                                         destinations[1][plan.dests[d].name].view(-1).view(torch.uint8))]
            same = not differ and delta.verify_seconds is not None
            identical &= same
            if differ:
                print(json.dumps({"case": f"{quant}-{lr:g}", "version": version, "differ": differ[:5]}), flush=True)
            wait([f"bench/stats/{version}/{r}" for r in range(args.trainers)], "delta stats")
            stats = [rendezvous.get_json(f"bench/stats/{version}/{r}") for r in range(args.trainers)]
            if version == 1:
                continue
            row = {"version": version, "took": delta.took, "density": sum(s["changed"] for s in stats) / sum(s["units"] for s in stats),
                   "delta_wire_ratio": delta.bytes / full.bytes, "delta_sync_s": delta.seconds - delta.verify_seconds,
                   "verify_s": delta.verify_seconds, "full_sync_s": full.seconds,
                   "encode_s": max(s["seconds"] for s in stats), "identical": same,
                   "overflow": sum(s["overflow"] for s in stats), "why": delta.why}
            rows.append(row)
            print(json.dumps({"case": f"{quant}-{lr:g}", **{k: round(v, 5) if isinstance(v, float) else v
                                                            for k, v in row.items()}}), flush=True)
        trainers.join()
        delta_rx.close()
        full_rx.close()
        med = {k: statistics.median(r[k] for r in rows) for k in ("density", "delta_wire_ratio", "delta_sync_s",
                                                                 "full_sync_s", "verify_s", "encode_s")}
        return {**{k: round(v, 5) for k, v in med.items()}, "identical": bool(identical and all(r["identical"] for r in rows)),
                "sender_extra_bytes": max(i["extra_bytes"] for i in info),
                "sender_page_bytes": max(i["page_bytes"] for i in info),
                "delta_took": sum(r["took"] == "delta" for r in rows), "steps": len(rows),
                "compared_fraction": round(shared_fraction, 4),
                "full_bytes": full.bytes, "seconds": round(time.perf_counter() - began, 1)}
    finally:
        trainers.close()
        shutil.rmtree(workdir, ignore_errors=True)


def encodings_table(seed: int = 0, pages: int = 64) -> dict:
    """Bytes per page of every encoding (and zlib over the chosen blob) against density, on random bf16 pages, and
    encode (diff included) and decode throughput over `pages` pages, best of 3 (page bytes per second)."""
    import zlib

    rng = np.random.default_rng(seed)
    n = 32768  # one 64 KiB page of bf16
    out = {}
    for density in (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.3, 0.6):
        previous = torch.randn(n * pages).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        current = previous.copy()
        hit = rng.random(n * pages) < density
        current[hit] ^= rng.integers(1, 1 << 16, int(hit.sum())).astype(np.uint16)
        cut = [slice(p * n, (p + 1) * n) for p in range(pages)]
        positions = changed(previous[cut[0]], current[cut[0]])
        sizes = encoded_sizes(n, 2, positions)
        blob = encode(current[cut[0]], positions)
        blobs, encode_s, decode_s = [], [], []
        for _ in range(3):
            t0 = time.perf_counter()
            blobs = [encode(current[c], changed(previous[c], current[c])) for c in cut]
            t1 = time.perf_counter()
            for b in blobs:
                decode(b, n, 2)
            encode_s.append(t1 - t0)
            decode_s.append(time.perf_counter() - t1)
        out[str(density)] = {**{e.name.lower(): round(sizes[e] / (2 * n), 4) for e in Encoding},
                             "chosen": Encoding(int(blob[0])).name.lower(),
                             "chosen_ratio": round(sum(len(b) for b in blobs) / (2 * n * pages), 4),
                             "zlib_ratio": round(sum(len(zlib.compress(b.tobytes(), 1)) for b in blobs) / (2 * n * pages), 4),
                             "encode_gbps": round(2 * n * pages / min(encode_s) / 1e9, 2),
                             "decode_gbps": round(2 * n * pages / min(decode_s) / 1e9, 2)}
    return out


def cut_config(layers: int) -> Path:
    """benchmarks/configs/bench-deepseek-v3 with its first `layers` decoder layers (0: all of them)."""
    if layers == 0:
        return CONFIG
    out = Path(tempfile.mkdtemp(prefix="weightplan-bench-delta-config-"))
    config = json.loads((CONFIG / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainers", type=int, default=4)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (each: one delta and one full sync)")
    p.add_argument("--layers", type=int, default=0, help="decoder layers of the bench config (0: all 9, the 1 GB model)")
    p.add_argument("--lrs", default="1e-6,1e-5")
    p.add_argument("--quants", default="none,fp8_per_block")
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--job", default=f"bench-delta-{os.getpid()}")
    p.add_argument("--encodings", action="store_true", help="only the encoding table (synthetic pages)")
    p.add_argument("--smoke", action="store_true", help=f"the smallest run ({' '.join(SMOKE[2:])}, the tiny example config)")
    for hidden, kw in (("--role", dict(choices=("inference", "trainer"), default="inference")),
                       ("--rank", dict(type=int, default=0)), ("--address", {}), ("--workdir", {}),
                       ("--lr", dict(type=float, default=1e-5))):
        p.add_argument(hidden, help=argparse.SUPPRESS, **kw)
    args = p.parse_args(argv)
    return p.parse_args([*SMOKE, *(argv if argv is not None else sys.argv[1:])]) if args.smoke else args


def main(args) -> int:
    if args.encodings:
        print(json.dumps({"encodings": encodings_table()}), flush=True)
        return 0
    config = cut_config(args.layers) if args.config == CONFIG else args.config
    cases = {}
    for quant in args.quants.split(","):
        for lr in (float(x) for x in args.lrs.split(",")):
            name = f"{'fp8_' if quant != 'none' else ''}lr_{lr:.0e}"
            cases[name] = run_case(args, config, lr, quant)
            print(json.dumps({"case": name, **cases[name]}), flush=True)
    config_bytes = sum(2 * p.numel() for p in mt.build_model(config, torch.bfloat16).parameters()) if not args.smoke else None
    print(json.dumps({**cases, "config": str(config), "layers": args.layers, "trainers": args.trainers,
                      "bf16_model_bytes": config_bytes, "date": time.strftime("%Y-%m-%d"),
                      "load": round(os.getloadavg()[0], 1)}), flush=True)
    return 0 if all(c["identical"] for c in cases.values()) else 1


if __name__ == "__main__":
    arguments = parse_args()
    sys.exit(run_trainer(arguments) if arguments.role == "trainer" else main(arguments))
