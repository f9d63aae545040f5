"""The inference side of the `weightplan` backend: a vLLM WeightTransferEngine that syncs plan versions over NIXL."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from weightplan.runtime import PlanMismatchError, Receiver, Rendezvous, load_plan
from weightplan.runtime.plan.schema import DerivedItem

from .engine_check import check_engine, plan_rank
from .live_patches import allow_forward, refuse_forward
from .init_info import InitInfoError, WeightplanInitInfo, WeightplanUpdateInfo
from .staging import Destination, choose

log = logging.getLogger("weightplan.vllm_backend")


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

    return get_tensor_model_parallel_rank() if model_parallel_is_initialized() else 0


class WeightplanWeightTransferEngine(WeightTransferEngine[WeightplanInitInfo, WeightplanUpdateInfo]):
    """One vLLM worker's end of a weightplan job: a Receiver for its plan rank, in direct or staged mode.

    `init_transfer_engine` validates the init info, picks the plan that matches this engine,
    refuses a mismatch before registering memory, chooses the mode and joins the job.
    `update_weights({"version": v})` syncs version v; in staged mode the engine keeps serving its
    previous weights until the whole sync has landed and been applied.
    """

    init_info_cls = WeightplanInitInfo
    update_info_cls = WeightplanUpdateInfo
    supports_draft_weight_update = False  # draft (MTP) plans are not handled by this backend yet

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: Receiver | None = None
        self.rendezvous: Rendezvous | None = None
        self.destination: Destination | None = None
        self.plan = None
        self.rank: int | None = None
        self.last: dict[str, Any] = {}

    def parse_init_info(self, init_dict: dict[str, Any]) -> WeightplanInitInfo:
        return WeightplanInitInfo.from_dict(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> WeightplanUpdateInfo:
        return WeightplanUpdateInfo.from_dict(update_dict)

    @property
    def platform(self) -> str:
        return torch.device(self.device).type

    def init_transfer_engine(self, init_info: WeightplanInitInfo) -> None:
        if self.receiver is not None:
            raise RuntimeError("the weightplan engine is already initialized; call shutdown_weight_transfer_engine first")
        rank = plan_rank(self.parallel_config, _tp_rank(), init_info.rank_offset)
        plan, names, errors = None, None, []
        for path in init_info.plans:
            candidate = load_plan(path)
            if init_info.fingerprint is not None and candidate.fingerprint != init_info.fingerprint:
                errors.append(f"{path}: fingerprint {candidate.fingerprint[:12]} is not the trainer's {init_info.fingerprint[:12]}")
                continue
            try:
                names = check_engine(candidate, rank, self.model, self.vllm_config, self.platform)
            except PlanMismatchError as exc:
                errors.append(str(exc))
                continue
            plan = candidate
            break
        if plan is None:
            raise PlanMismatchError("no plan given to the weightplan backend fits this engine: " + " | ".join(errors))
        destination = choose(plan, names, self.model, self.platform, init_info.mode)
        derived = [d for d in plan.derived if d.where == DerivedItem.RECEIVER and set(d.reads) <= set(names)]
        self.derived = [self.model.get_submodule(d.module) for d in derived]
        rendezvous = Rendezvous.connect(init_info.job, init_info.address, timeout=init_info.timeout)
        self.receiver = Receiver(plan, rank, destination.tensors, rendezvous=rendezvous, timeout=init_info.timeout,
                                 verify=init_info.verify, derived="caller")
        self.receiver.start()
        self.plan, self.rank, self.rendezvous, self.destination = plan, rank, rendezvous, destination
        log.info("weightplan backend: inference rank %d, plan %s (%s), %s mode (%s), %.1f MB staged",
                 rank, plan.header.get("model"), plan.fingerprint[:12], destination.mode, destination.reason,
                 destination.staging_bytes / 1e6)

    def info(self) -> dict[str, Any]:
        """What this worker runs: rank, mode and why, plan, last update's timings (for collective_rpc reports)."""
        d = self.destination
        return {"rank": self.rank, "mode": d.mode if d else None, "reason": d.reason if d else None,
                "plan": self.plan.fingerprint if self.plan else None, "staging_bytes": d.staging_bytes if d else 0,
                "version": self.receiver.version if self.receiver else None, **self.last}

    def start_weight_update(self) -> None:
        if self.receiver is None:
            raise RuntimeError("weightplan backend: init_weight_transfer_engine must be called before a weight update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class calls torch.accelerator.synchronize(), which raises on CPU torch; READs are complete here.
        self.receive_weights(self.parse_update_info(update_info))
        if self.platform != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: WeightplanUpdateInfo) -> None:
        if self.receiver is None:
            raise RuntimeError("weightplan backend: init_weight_transfer_engine must be called before update_weights")
        if self.model is not self._default_model:
            raise RuntimeError("weightplan backend: draft-model updates are not supported")
        began = time.perf_counter()
        try:
            report = self.receiver.sync(update_info.version)
        except Exception as exc:
            if self.destination.mode == "direct":  # the live weights are incomplete: refuse to serve them
                refuse_forward(self.model, f"version {update_info.version}: {str(exc)[:200]}")
            raise  # staged: the buffers are incomplete, the engine still serves the previous weights whole
        allow_forward(self.model)
        transferred = time.perf_counter()
        self.destination.apply()
        with torch.no_grad():
            for module in self.derived:
                module.process_weights_after_loading(self.model_config.dtype)
        done = time.perf_counter()
        self.last = {"version": update_info.version, "transfer_s": transferred - began, "post_process_s": done - transferred,
                     "bytes": report.bytes, "descriptors": report.descriptors}
        log.info("weightplan backend: version %d on inference rank %d: %.3f s transfer, %.3f s post-process (%s mode)",
                 update_info.version, self.rank, self.last["transfer_s"], self.last["post_process_s"], self.destination.mode)

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        receiver, self.receiver = self.receiver, None
        if receiver is not None:
            receiver.close()
        self.rendezvous = self.destination = self.plan = None


__all__ = ["InitInfoError", "WeightplanWeightTransferEngine"]
