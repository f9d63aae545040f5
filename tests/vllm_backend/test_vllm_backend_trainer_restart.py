"""Every trainer process of a job killed and restarted under a live vLLM engine, the rendezvous on etcd: the engine,
never restarted nor re-initialised, takes the restarted trainers' next version and generates what a fresh engine on
that checkpoint generates (issue 52). The engine is a replica beyond the plan's ranks (the pool grown by one): inference
rank 1 of a one-rank plan, with the tables of the rank it copies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from weightplan.testing.engines import (
    CONFIGS, ROOT, backend_info, full_weights, greedy, make_llm, pin_no_amx, read_references, shutdown,
    start_references, write_checkpoint,
)

from ..support.etcd import EtcdCluster
from ..support.trainer_events import trainer_event

MODEL = "engine-qwen3-moe"
JOB = "restart"
TIMEOUT = 30.0
POOL = 2  # the plan has inference rank 0; the engine joins as rank 1, the pool's second replica


class Trainers:
    """Trainer ranks 0 and 1 of the plan as processes (testing/engine_trainer.py); the test drives the engine."""

    def __init__(self, tmp: Path, plan_path: Path, address: str):
        self.tmp, self.plan_path, self.address = tmp, plan_path, address
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, tag: str, first_version: int) -> None:
        for rank in (0, 1):
            key = f"{tag}-{rank}"
            cmd = [sys.executable, "-m", "weightplan.testing.engine_trainer", "--plan", str(self.plan_path), "--rank",
                   str(rank), "--address", self.address, "--job", JOB, "--timeout", str(TIMEOUT), "--sets", "1,2,3",
                   "--first-version", str(first_version), "--pool-ranks", str(POOL)]
            self.procs[key] = subprocess.Popen(cmd, cwd=ROOT, stdout=open(self.tmp / f"{key}.out", "w"),
                                               stderr=open(self.tmp / f"{key}.err", "w"))
        for rank in (0, 1):
            self.event(f"{tag}-{rank}", "ready")

    def event(self, key: str, kind: str, version: int | None = None, timeout: float = 180) -> dict:
        return trainer_event(self.tmp, key, self.procs[key], kind, version, timeout)

    def kill(self, tag: str) -> None:
        for rank in (0, 1):
            proc = self.procs[f"{tag}-{rank}"]
            proc.kill()
            proc.wait()

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _sync(client, gate, trainers: Trainers, tag: str, version: int) -> None:
    """Both trainer ranks send `version`; this process drives the engine's update as trainer rank 0's engine would."""
    from weightplan.vllm_backend.clients import finish_update

    gate.put(f"test/go/{version}", b"1")
    client.start_weight_update()
    client.update_weights({"version": version})
    finish_update(client, version)
    for rank in (0, 1):
        assert trainers.event(f"{tag}-{rank}", "sent", version)["acked"] == [1]  # rank 0 never joined: not awaited


def test_every_trainer_killed_and_restarted_is_taken_by_the_live_engine_at_its_next_version(tmp_path,
                                                                                             no_job_secret_in_the_environment):
    from weightplan.compiler.compile import CompileOptions, compile_plan
    from weightplan.runtime import Rendezvous, load_plan
    from weightplan.vllm_backend.clients import LLMClient
    from weightplan.vllm_backend.trainer import WeightplanTrainerInitInfo

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function (tests only)
    etcd = EtcdCluster(tmp_path / "etcd", 1)
    unpin = pin_no_amx(tmp_path)
    plan_path = compile_plan(CompileOptions(model=str(CONFIGS / MODEL), trainer_format="hf", trainer="fsdp=2",
                                            output=tmp_path / "fsdp2.plan")).path
    plan = load_plan(plan_path)
    checkpoints = {s: write_checkpoint(CONFIGS / MODEL, full_weights(plan, 0, s), tmp_path / f"ckpt-{s}")
                   for s in (1, 2, 3)}
    references = start_references(checkpoints, tmp_path / "refs.json", tmp_path / "refs.log")
    trainers = Trainers(tmp_path, plan_path, etcd.address)
    llm = None
    try:
        llm = make_llm(CONFIGS / MODEL, dummy=True, backend=True)
        trainers.start("first", first_version=1)
        client = LLMClient(llm)
        info = WeightplanTrainerInitInfo(rank=0, plan=str(plan_path), address=etcd.address, job=JOB, timeout=TIMEOUT,
                                         pool_ranks=POOL, engine={"rank_offset": 1})
        client.init_weight_transfer_engine(info.worker_init_info(plan.fingerprint))
        gate = Rendezvous.connect(JOB, etcd.address, timeout=TIMEOUT)
        refs = read_references(references, tmp_path / "refs.json", tmp_path / "refs.log")
        assert len({json.dumps(refs[s]) for s in (1, 2, 3)}) == 3, "the weight sets must generate differently"

        for version in (1, 2):
            _sync(client, gate, trainers, "first", version)
            assert greedy(llm) == refs[version], f"version {version} differs from a fresh engine on its checkpoint"
        trainers.kill("first")  # SIGKILL between versions: no process of the job's trainers is left; etcd keeps the records

        trainers.start("restarted", first_version=3)  # resumed from the step-2 checkpoint: its next version is 3
        _sync(client, gate, trainers, "restarted", 3)
        assert greedy(llm) == refs[3], "the restarted trainers' version differs from a fresh engine on its checkpoint"
        engine = llm.collective_rpc(backend_info)[0]
        assert (engine["rank"], engine["version"], llm.get_weight_version()) == (1, 3, "3"), engine
    finally:
        trainers.close()
        if llm is not None:
            shutdown(llm)
        unpin()
        etcd.close()
