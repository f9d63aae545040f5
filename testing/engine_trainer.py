"""A trainer rank (>= 1) of the vLLM engine tests: a WeightplanTrainerEngine that sends a version when the test says so.

Run as `python -m weightplan.testing.engine_trainer --plan P --rank R --address A --job J --seed S`; waits for
`test/go/<v>` in the store, sends version v (publish + release) with weight set `--sets`[v - 1] (`s`: a sparse step
of the previous version's weights, `sparse_step(previous, v)`) and prints one JSON line per version.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from weightplan.runtime import Rendezvous, load_plan
from weightplan.vllm_backend.trainer import ShardSource, WeightplanTrainerInitInfo, start_trainer_engine

from weightplan.testing.engines import full_weights, local_shards, sparse_step


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--plan", "--address", "--job"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--sets", default="1,2,3", help="weight set of each version, from version 1 (s: a sparse step)")
    parser.add_argument("--first-version", type=int, default=1)
    parser.add_argument("--delta", type=float, default=0.0, help="the Sender's delta fraction (0: full syncs only)")
    parser.add_argument("--pool-ranks", type=int, default=None, help="the Sender's pool_ranks (None: the plan's)")
    parser.add_argument("--hold-after-publish", type=int, default=0, help="publish this version, then hang (to be killed)")
    args = parser.parse_args()
    plan = load_plan(args.plan)
    sets = [x if x == "s" else int(x) for x in args.sets.split(",")]
    full = full_weights(plan, args.seed, sets[args.first_version - 1])
    tensors = local_shards(plan, full, args.rank)
    info = WeightplanTrainerInitInfo(rank=args.rank, plan=args.plan, address=args.address, job=args.job,
                                     timeout=args.timeout, delta=args.delta, pool_ranks=args.pool_ranks)
    engine = start_trainer_engine(info, client=None, source=ShardSource(tensors))
    gate = Rendezvous.connect(args.job, args.address, timeout=args.timeout)
    print(json.dumps({"event": "ready", "rank": args.rank}), flush=True)
    version = args.first_version - 1
    while True:
        upcoming = None  # the next version's values, computed before the go so that a sync never waits for them
        if version + 1 <= len(sets) and version + 1 != args.first_version:
            step = sets[version]
            full = sparse_step(full, version + 1) if step == "s" else full_weights(plan, args.seed, step)
            upcoming = local_shards(plan, full, args.rank)
        print(json.dumps({"event": "prepared", "version": version + 1}), flush=True)
        gate.wait([f"test/go/{version + 1}"], 3600, "the test's go")
        version += 1
        if gate.exists(f"test/stop/{version}"):
            break
        for name, value in (upcoming or {}).items():  # an optimizer step: new values in the same tensors
            tensors[name].copy_(value)
        if version == args.hold_after_publish:  # a trainer that dies mid-update: published, then killed by the test
            engine.sender.publish(version)
            print(json.dumps({"event": "published", "version": version}), flush=True)
            time.sleep(3600)
        engine.send_weights(version)
        report = engine.last_release
        print(json.dumps({"event": "sent", "version": version, "acked": list(report.acked),
                          "failed": list(report.failed), "timed_out": list(report.timed_out)}), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
