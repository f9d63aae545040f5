"""One rank of a pipeline-parallel FSDP2 trainer over a real gloo process group, for tests/runtime/test_pipeline_layout.py.

Run as `python -m tests.support.pipeline_trainer_worker --rank R --world W --pp P --workdir DIR --model CONFIG_DIR`.
The rank builds only its stage's layers (torchtitan's split, global indices kept), shards them with
`fully_shard` on its stage's sub-mesh (`init_device_mesh(("pp", "fsdp"))["fsdp"]`), and calls
`write_pipeline_layout` with every other rank (DIR/trainer-layout.json). Then it waits for DIR/go.json
(the plan the test compiled, the job and the store address), checks that its stage module is refused
as a rank of the next stage, fills its shards with version v's weights (runtime_worker.full_weights,
what the inference workers check against) and serves each version through a LiveSender on the stage module.
Prints one JSON line per event.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch
import torch.distributed as dist

from weightplan.runtime import LiveSender, PlanMismatchError, Rendezvous, load_plan, trainer_tensors, write_pipeline_layout
from weightplan.runtime.transport import protocol
from .pipeline_stage import stage_module
from weightplan.testing.runtime_worker import emit, full_weights, shard


def build_stage(model_dir: str, rank: int, world: int, pp: int, layers: list[int]) -> torch.nn.Module:
    """This rank's stage module, FSDP2-sharded over the stage's ranks, on CPU (uninitialised)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    mesh = init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "fsdp"))
    stage = rank // (world // pp)
    start = sum(layers[:stage])
    with torch.device("meta"):
        full = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), torch_dtype=torch.float32)
    module = stage_module(full, stage, range(start, start + layers[stage]), stage == pp - 1)
    for layer in module.model.layers.values():
        fully_shard(layer, mesh=mesh["fsdp"])
    fully_shard(module, mesh=mesh["fsdp"])
    return module.to_empty(device="cpu")


def wait_for(path: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path} within {timeout} s")
        time.sleep(0.1)
    return json.loads(path.read_text())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--layers", required=True, help="layers per stage, e.g. 2+1 (torchtitan's split)")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--versions", type=lambda s: [int(v) for v in s.split(",")], default=[1])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo", init_method=f"file://{args.workdir / 'gloo-store'}", rank=args.rank, world_size=args.world)
    module = build_stage(args.model, args.rank, args.world, args.pp, [int(n) for n in args.layers.split("+")])
    write_pipeline_layout(module, args.workdir / "trainer-layout.json")
    emit(event="layout", rank=args.rank, tensors=sorted(trainer_tensors(module)))
    go = wait_for(args.workdir / "go.json", 300)
    plan = load_plan(go["plan"])
    per_stage = args.world // args.pp
    other = (args.rank // per_stage + 1) % args.pp * per_stage  # the first rank of the next stage
    try:
        LiveSender(plan, other, module)
        refused = None
    except PlanMismatchError as exc:
        refused = str(exc)
    emit(event="refused", rank=args.rank, as_rank=other, error=refused)
    rendezvous = Rendezvous.connect(go["job"], go["address"], timeout=args.timeout)
    sender = LiveSender(plan, args.rank, module, rendezvous=rendezvous, timeout=args.timeout, verify=True).start()
    deadline = time.monotonic() + 300
    while not all(rendezvous.exists(protocol.joined_key(k)) for k in sender.readers):
        if time.monotonic() > deadline:
            raise SystemExit("inference ranks did not join")
        time.sleep(0.05)
    for version in args.versions:
        local = shard(plan, full_weights(plan, args.seed, version), args.rank)
        with torch.no_grad():  # an optimizer step: new values in the module's own shards
            for name, tensor in trainer_tensors(module).items():
                tensor.to_local().copy_(local[name])
        sender.publish(version)
        report = sender.release(version)
        emit(event="released", rank=args.rank, version=version, acked=list(report.acked), failed=list(report.failed),
             timed_out=list(report.timed_out), reregistered=sender.reregistered)
    sender.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
