"""One FSDP2 policy rank of a gloo world running SkyRL 0.4.0's trainer-side weight sync with weightplan, step by step.

Run as `python -m weightplan.testing.skyrl_trainer_rank --config C --server URL --workdir D --out O --job J --steps S`
with the variables SkyRL's policy workers set (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK;
tests/frameworks/test_skyrl_ranks.py): joins the world (gloo), builds `fsdp2_llama(C)` over it, calls SkyRL's own
`weight_senders.build_trainer_engine` with weight_sync_backend="weightplan", its own `FsdpWeightSource` and its own HTTP
client for the server at URL, and prints a `built` JSON line. Then for each step v it waits for `test/go/<v>` in the
job's store, takes one `train_step`, calls `engine.send_weights()`, gathers the full state dict (rank 0 saves it to
O/full-<v>.safetensors, the test's reference) and prints a `sent` line. `gathered` in both lines: how often the adapter called
`DTensor.full_tensor` (the reference gather is not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--config", "--server", "--workdir", "--out", "--job"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args()

    from skyrl.backends.skyrl_train.weight_sync import weight_senders
    from skyrl.backends.skyrl_train.weight_sync.sources import FsdpWeightSource
    from safetensors.torch import save_file
    from skyrl.train.config.config import InferenceEngineConfig
    from torch.distributed.tensor import DTensor

    from weightplan.adapters import skyrl as adapter
    from weightplan.runtime import Rendezvous
    from weightplan.testing.fsdp2_policy import counting_full_tensor, fsdp2_llama, train_step

    dist.init_process_group("gloo")  # env://, as SkyRL's Worker.init_worker_process_group (its CPU half)
    rank = dist.get_rank()
    model = fsdp2_llama(args.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    adapter.install(adapter.WeightplanSettings(workdir=args.workdir, job=args.job))
    gathered, full_tensor = [], DTensor.full_tensor
    DTensor.full_tensor = counting_full_tensor(gathered)  # the adapter must never gather

    def source_factory(dtype, backend):  # FsdpWorker._build_weight_source's non-RDT branch
        return FsdpWeightSource(model, dtype, "")

    def no_draft(dtype):
        raise AssertionError("no spec-decode drafter here")

    world = _world_size(args.server)
    engine = _off_loop(
        weight_senders.build_trainer_engine,
        ie_cfg=InferenceEngineConfig(weight_sync_backend="weightplan", model_dtype="bfloat16"), colocate_all=False,
        rank=rank, inference_world_size=world, source_factory=source_factory, draft_source_factory=no_draft,
        server_urls=[args.server], data_parallel_size=1, base_model_path=args.config)
    dist.barrier()  # as SkyRL's init_weight_sync_state
    info = engine.init_info
    print(json.dumps({"event": "built", "rank": rank, "engine": type(engine).__name__, "plan": info.plan,
                      "address": info.address, "is_sender": engine.is_sender, "client": type(engine.client).__name__,
                      "source_is_model": engine.source.tensors is model, "gathered": len(gathered)}), flush=True)
    gate = Rendezvous.connect(args.job, info.address, timeout=info.timeout)
    for step in range(1, args.steps + 1):
        gate.wait([f"test/go/{step}"], 600, "the test's go")
        train_step(model, optimizer)
        gathered.clear()  # FSDP2's own gathers (if any) are the trainer's business
        _off_loop(engine.send_weights)  # what Worker._sync_weights_to_inference_engines calls, on every rank
        sent = {"event": "sent", "rank": rank, "version": engine.version, "gathered": len(gathered),
                "acked": list(engine.last_release.acked)}
        full = {name: full_tensor(t).detach() for name, t in model.state_dict().items()}  # the reference only
        if rank == 0:
            path = os.path.join(args.out, f"full-{step}.safetensors")
            save_file(full, path + ".tmp")
            os.replace(path + ".tmp", path)
        print(json.dumps(sent), flush=True)
    if rank != 0:
        weight_senders.teardown_engine(engine)
    dist.barrier()  # rank 0 serves the store the other ranks' shutdown writes to
    if rank == 0:
        weight_senders.teardown_engine(engine)
    dist.destroy_process_group()


def _off_loop(fn, *args, **kwargs):
    """`fn` as SkyRL's Worker._weight_sync_thread runs it: `asyncio.to_thread`, off the worker's event loop."""
    return asyncio.run(asyncio.to_thread(fn, *args, **kwargs))


def _world_size(server: str, timeout: float = 600) -> int:
    """The server's inference world size over vLLM's route, as SkyRL's worker asks it
    (RemoteInferenceClient.get_world_size), once the server is up (the test starts it while the ranks start)."""
    import requests

    deadline = time.monotonic() + timeout
    while True:
        try:
            return requests.get(f"{server}/get_world_size", timeout=30).json()["world_size"]
        except requests.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


if __name__ == "__main__":
    main()
