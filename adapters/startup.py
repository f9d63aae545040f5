"""The trainer-engine start-up the RL framework adapters share: init info from PublishSettings, one engine per replica."""

from __future__ import annotations

from typing import Any

from .settings import PublishSettings


def replica_job(job: str, replica: int) -> str:
    """The job id of engine replica `replica`: each replica reads the plan in its own job."""
    return f"{job}.replica{replica}"


def trainer_init_info(settings: PublishSettings, *, rank: int, plan: str, address: str, job: str | None = None,
                      info_cls: type | None = None, **fields: Any):
    """This trainer rank's init info (`info_cls`, default WeightplanTrainerInitInfo) with the settings' timeout, verify
    and delta, the settings' job unless `job` is given, and the adapter's own `fields` (serve_store, drives, ...)."""
    from weightplan.vllm_backend.trainer import WeightplanTrainerInitInfo

    cls = info_cls or WeightplanTrainerInitInfo
    return cls(rank=rank, plan=plan, address=address, job=job or settings.job, timeout=settings.timeout,
               verify=settings.verify, delta=settings.delta, **fields)


def start_engine(info, shards, client=None):
    """This rank's trainer engine for `info`, publishing `shards` (a module, or {name: local shard}) without gathering;
    `client` drives the vLLM engine (None: another rank, or nobody, drives it)."""
    from weightplan.vllm_backend.trainer import ShardSource, start_trainer_engine

    return start_trainer_engine(info, client=client, source=ShardSource(shards))
