"""The `vllm.general_plugins` entry point: registers the weightplan backend on both factories, once per process."""

from __future__ import annotations

from . import BACKEND

ENGINE = ("weightplan.vllm_backend.engine", "WeightplanWeightTransferEngine")
TRAINER = ("weightplan.vllm_backend.trainer", "WeightplanTrainerEngine")


def register() -> None:
    """Register `weightplan` (lazily imported) unless this process already did: plugins load several times."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, (module, cls) in ((WeightTransferEngineFactory, ENGINE), (WeightTransferTrainerFactory, TRAINER)):
        try:
            factory.register_engine(BACKEND, module, cls)
        except ValueError as exc:  # the factories refuse a duplicate name: this process registered it before
            if "already registered" not in str(exc):
                raise
