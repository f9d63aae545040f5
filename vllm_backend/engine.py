"""The inference side of the `weightplan` backend: a vLLM WeightTransferEngine that syncs plan versions over NIXL."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from weightplan.runtime import Plan, PlanMismatchError, Receiver, Rendezvous, load_plan
from weightplan.runtime.plan.schema import DerivedItem
from weightplan.runtime.tables.ranks import layout_rank

from .engine_check import check_engine, check_lora_engine, plan_rank
from .eplb import engine_expert_map
from .live_patches import allow_forward, refuse_forward
from .init_info import InitInfoError, WeightplanInitInfo, WeightplanUpdateInfo
from .lora_update import LoraSide
from .prefetch import BackgroundSync
from .staging import Destination, choose

log = logging.getLogger("weightplan.vllm_backend")


def _tp_pp_ranks() -> tuple[int, int]:
    """This worker's ranks in vLLM's tensor and pipeline parallel groups."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group, model_parallel_is_initialized

    return (get_tp_group().rank_in_group, get_pp_group().rank_in_group) if model_parallel_is_initialized() else (0, 0)


@dataclass
class Side:
    """One model this worker updates, the target or the speculative draft: its plan, where READs land, its Receiver.

    `receiver` is replaced (`follow_experts`) when the engine's EPLB table moved experts since it was made."""

    model: torch.nn.Module
    plan: Plan
    receiver: Receiver
    rendezvous: Rendezvous
    destination: Destination
    derived: tuple[torch.nn.Module, ...]  # modules whose derived post-load state (MLA absorption) is recomputed
    make_receiver: Callable[[np.ndarray | None], Receiver] | None = None  # expert map -> a started Receiver like it

    def moved_experts(self) -> np.ndarray | None:
        """With an EPLB plan, the engine's current table if vLLM's balancer rearranged the experts since the Receiver
        was made, else None."""
        eplb = self.plan.header.inference.eplb
        if eplb is None:
            return None
        current = engine_expert_map(self.model, eplb)
        return None if np.array_equal(current, self.receiver.expert_map) else current

    def follow_experts(self, expert_map: np.ndarray) -> None:
        """Replace the Receiver by one reading on `expert_map` (the old one leaves the job first)."""
        self.receiver.close()
        self.receiver = self.make_receiver(expert_map)

    def close(self) -> None:
        self.receiver.close()


class WeightplanWeightTransferEngine(WeightTransferEngine[WeightplanInitInfo, WeightplanUpdateInfo]):
    """One vLLM worker's end of a weightplan job: a Receiver for its plan rank, in direct or staged mode.

    `init_transfer_engine` validates the init info, picks the plan that matches this engine,
    refuses a mismatch before registering memory, chooses the mode and joins the job.
    `update_weights({"version": v})` syncs version v; in staged mode the engine keeps serving its
    previous weights until the whole sync has landed and been applied. In staged mode,
    `update_weights({"version": v, "prefetch": True})` starts that sync on a background thread and returns at once,
    so the engine keeps generating while the bytes move; the next `update_weights({"version": v})` waits for it and
    only applies (direct mode ignores `prefetch`: its sync writes the live weights). With init info `delta` > 0 the
    Receiver takes deltas when it holds the previous version; `info()` reports which the last update took.

    With `draft_plan` in the init info, `supports_draft_weight_update` is True: vLLM's
    `start_draft_weight_update` retargets the engine at the speculative draft model
    (`set_weight_update_target`), and the updates until `finish_weight_update` sync the draft
    plan (job `job + ".draft"`) into it. The draft side is checked against the live draft and
    joins its job at the first draft update, the first time the engine sees the draft model.

    Given a LoRA plan (`compile-plan --lora`, engine started with enable_lora and max_loras >= 2), every update
    writes that adapter version into one of two LoRA slots in turn and serves it under adapter id = version
    (`lora_update.LoraSide`, docs/lora.md); the base weights are not touched.
    """

    init_info_cls = WeightplanInitInfo
    update_info_cls = WeightplanUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.target: Side | None = None
        self.lora: LoraSide | None = None
        self.draft: Side | None = None
        self.draft_plans: list[Plan] = []
        self.init_info: WeightplanInitInfo | None = None
        self.rank: int | None = None
        self.last: dict[str, Any] = {}
        self.last_draft: dict[str, Any] = {}
        self.prefetches: dict[str, BackgroundSync] = {}  # "target" or "draft": a sync running into staging
        self.prefetch_rpc_s: dict[str, float] = {}  # how long the prefetch call held the worker, per side

    @property
    def supports_draft_weight_update(self) -> bool:  # vLLM's worker asks before start_draft_weight_update
        return bool(self.draft_plans)

    @property
    def side(self) -> Side | None:
        """The side the current weight update targets (vLLM's set_weight_update_target decides)."""
        return self.target if self.model is self._default_model else self.draft

    # Reports of the target side (what `info()` and the tests read).
    @property
    def receiver(self) -> Receiver | None:
        return self.target.receiver if self.target else None

    @property
    def destination(self) -> Destination | None:
        return self.target.destination if self.target else None

    @property
    def plan(self) -> Plan | None:
        return self.target.plan if self.target else None

    def parse_init_info(self, init_dict: dict[str, Any]) -> WeightplanInitInfo:
        return WeightplanInitInfo.from_dict(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> WeightplanUpdateInfo:
        return WeightplanUpdateInfo.from_dict(update_dict)

    @property
    def platform(self) -> str:
        return torch.device(self.device).type

    def init_transfer_engine(self, init_info: WeightplanInitInfo) -> None:
        if self.target is not None or self.lora is not None:
            raise RuntimeError("the weightplan engine is already initialized; call shutdown_weight_transfer_engine first")
        rank = plan_rank(self.parallel_config, *_tp_pp_ranks(), init_info.rank_offset)
        plans = [(path, load_plan(path)) for path in init_info.plans]
        if any(plan.header.inference.lora is not None for _, plan in plans):
            self.lora = self._join_lora(init_info, rank, plans)
            self.init_info, self.rank = init_info, rank
            return
        draft_plans = [load_plan(path) for path in init_info.draft_plans]  # unreadable files refused before joining
        self.target = self._join(init_info, rank, plans, self.model, self.model_config, None, init_info.job)
        self.init_info, self.rank, self.draft_plans = init_info, rank, draft_plans

    def _join(self, init_info: WeightplanInitInfo, rank: int, plans: list[tuple[str, Plan]], model: torch.nn.Module,
              model_config, target: torch.nn.Module | None, job: str) -> Side:
        """Pick the first plan that fits `model` (the draft when `target` is given), choose the mode and join `job`."""
        plan, names, errors = None, None, []
        for path, candidate in plans:
            if target is None and init_info.fingerprint is not None and candidate.fingerprint != init_info.fingerprint:
                errors.append(f"{path}: fingerprint {candidate.fingerprint[:12]} is not the trainer's {init_info.fingerprint[:12]}")
                continue
            try:  # a replica beyond the plan's ranks (init_info.pool_ranks) is checked as the plan rank it copies
                names = check_engine(candidate, layout_rank(candidate, rank, init_info.pool_ranks), model,
                                     self.vllm_config, self.platform, model_config=model_config, target=target)
            except PlanMismatchError as exc:
                errors.append(str(exc))
                continue
            plan = candidate
            break
        what = "draft plan" if target is not None else "plan"
        if plan is None:
            raise PlanMismatchError(f"no {what} given to the weightplan backend fits this engine: " + " | ".join(errors))
        destination = choose(plan, names, model, self.platform, init_info.mode)
        derived = [d for d in plan.derived if d.where == DerivedItem.RECEIVER and set(d.reads) <= set(names)]
        rendezvous = Rendezvous.connect(job, init_info.address, timeout=init_info.timeout)
        eplb = plan.header.inference.eplb

        def make_receiver(expert_map) -> Receiver:
            return Receiver(plan, rank, destination.tensors, rendezvous=rendezvous, timeout=init_info.timeout,
                            verify=init_info.verify, derived="caller", delta=init_info.delta,
                            pool_ranks=init_info.pool_ranks, expert_map=expert_map).start()

        receiver = make_receiver(None if eplb is None else engine_expert_map(model, eplb))
        log.info("weightplan backend: inference rank %d, %s %s (%s), %s mode (%s), %.1f MB staged", rank, what,
                 plan.header.model, plan.fingerprint[:12], destination.mode, destination.reason,
                 destination.staging_bytes / 1e6)
        return Side(model, plan, receiver, rendezvous, destination, tuple(model.get_submodule(d.module) for d in derived),
                    make_receiver)

    def _join_lora(self, init_info: WeightplanInitInfo, rank: int, plans: list[tuple[str, Plan]]) -> LoraSide:
        """Check the LoRA plan against this engine's LoRA layers and join its job (nothing registered until an update)."""
        if len(plans) != 1 or init_info.draft_plan is not None or init_info.delta or init_info.pool_ranks is not None:
            raise InitInfoError("weightplan init_info with a LoRA plan takes exactly one plan, no 'draft_plan', no "
                                "'delta' and no 'pool_ranks'")
        path, plan = plans[0]
        if init_info.fingerprint is not None and plan.fingerprint != init_info.fingerprint:
            raise PlanMismatchError(f"{path}: fingerprint {plan.fingerprint[:12]} is not the trainer's "
                                    f"{init_info.fingerprint[:12]}")
        manager = getattr(self.model, "lora_manager", None)
        check_lora_engine(plan, rank, self.vllm_config, self.platform, manager)
        side = LoraSide(plan, rank, manager, Rendezvous.connect(init_info.job, init_info.address, timeout=init_info.timeout),
                        timeout=init_info.timeout, verify=init_info.verify, slots=init_info.lora_slots).join()
        log.info("weightplan backend: inference rank %d, LoRA plan %s (%s), slots %s", rank, plan.header.model,
                 plan.fingerprint[:12], init_info.lora_slots)
        return side

    def info(self) -> dict[str, Any]:
        """What this worker runs: rank, mode and why, plan, last update's timings (for collective_rpc reports)."""
        if self.lora is not None:
            return {"rank": self.rank, **self.lora.info(), **self.last}
        report = {"rank": self.rank, **_side_info(self.target), **self.last}
        if self.draft_plans:
            report["draft"] = {**_side_info(self.draft), **self.last_draft}
        return report

    def start_weight_update(self) -> None:
        if self.target is None and self.lora is None:
            raise RuntimeError("weightplan backend: init_weight_transfer_engine must be called before a weight update")
        if self.model is self._default_model or self.draft is not None:
            return
        if not self.draft_plans:  # vLLM checks supports_draft_weight_update first; a direct caller may not
            raise RuntimeError("weightplan backend: a draft-model update needs init_info field 'draft_plan'")
        self.draft = self._join(self.init_info, self.rank, [(p.header.model, p) for p in self.draft_plans], self.model,
                                self.model_config, self._default_model, self.init_info.draft_job)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class calls torch.accelerator.synchronize(), which raises on CPU torch; READs are complete here.
        self.receive_weights(self.parse_update_info(update_info))
        if self.platform != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: WeightplanUpdateInfo) -> None:
        if self.lora is not None:
            if update_info.prefetch:
                raise InitInfoError("weightplan update_info field 'prefetch': LoRA updates write a free slot directly, "
                                    "there is nothing to prefetch")
            self.last = self.lora.update(update_info.version)
            log.info("weightplan backend: LoRA version %d on inference rank %d into slot %d (adapter id %d), %.3f s",
                     update_info.version, self.rank, self.last["slot"], self.last["lora_id"], self.last["transfer_s"])
            return
        if self.target is None:
            raise RuntimeError("weightplan backend: init_weight_transfer_engine must be called before update_weights")
        side = self.side
        if side is None:
            raise RuntimeError("weightplan backend: start_draft_weight_update must be called before a draft update")
        began = time.perf_counter()
        key = "target" if side is self.target else "draft"
        pending = self.prefetches.pop(key, None)
        moved = side.moved_experts()
        if moved is not None:  # vLLM's balancer rearranged the experts since the Receiver was made
            if pending is not None:  # it read on the old table: let it end, then sync anew
                _settle(pending)
                pending = None
            side.follow_experts(moved)
            log.info("weightplan backend: inference rank %d follows vLLM's rearranged experts (new Receiver)", self.rank)
        if update_info.prefetch and side.destination.mode == "staged":
            if pending is not None:  # an earlier prefetch never applied: let it end (its bytes are overwritten)
                _settle(pending)
            self.prefetches[key] = BackgroundSync(side.receiver, update_info.version)
            self.prefetch_rpc_s[key] = time.perf_counter() - began
            return
        if update_info.prefetch:
            return  # direct mode: the update itself syncs
        prefetched = pending is not None and pending.version == update_info.version
        try:
            if prefetched:
                report = pending.wait()
            else:
                if pending is not None:
                    _settle(pending)
                report = side.receiver.sync(update_info.version)
        except Exception as exc:
            if side.destination.mode == "direct":  # the live weights are incomplete: refuse to serve them
                refuse_forward(side.model, f"version {update_info.version}: {str(exc)[:200]}")
            raise  # staged: the buffers are incomplete, the engine still serves the previous weights whole
        allow_forward(side.model)
        transferred = time.perf_counter()
        side.destination.apply()
        with torch.no_grad():
            for module in side.derived:
                module.process_weights_after_loading(self.model_config.dtype)
        done = time.perf_counter()
        # pause_s: the time this worker spent inside this version's update calls, when it could run no forward pass.
        last = {"version": update_info.version, "transfer_s": pending.seconds if prefetched else transferred - began,
                "post_process_s": done - transferred, "prefetched": prefetched, "wait_s": transferred - began,
                "pause_s": done - began + (self.prefetch_rpc_s.pop(key, 0.0) if prefetched else 0.0),
                "took": report.took, "delta_trainers": list(report.delta_trainers), "delta_bytes": report.delta_bytes,
                "bytes": report.bytes, "descriptors": report.descriptors}
        if side is self.target:
            self.last = last
        else:
            self.last_draft = last
        log.info("weightplan backend: %sversion %d on inference rank %d: %.3f s transfer (%s%s), %.3f s post-process, "
                 "%.3f s paused (%s mode)", "draft " if side is self.draft else "", update_info.version, self.rank,
                 last["transfer_s"], report.took, ", prefetched" if prefetched else "", last["post_process_s"],
                 last["pause_s"], side.destination.mode)

    def finish_weight_update(self) -> None:
        if self.lora is not None:  # vLLM's worker resets its LoRA state right after this call
            self.lora.keep_routes_across_reset()

    def shutdown(self) -> None:
        for pending in self.prefetches.values():
            _settle(pending)
        self.prefetches = {}
        if self.lora is not None:
            self.lora.close()
        self.lora = None
        sides, self.target, self.draft = (self.target, self.draft), None, None
        for side in sides:
            if side is not None:
                side.close()
        self.draft_plans = []

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        """vLLM 0.26's static trainer-side send (abstract there, gone by 0.30): weightplan's trainers publish from
        their own shards through the trainer engine instead, which a one-shot iterator of full tensors cannot feed."""
        raise NotImplementedError("the weightplan backend sends from each trainer rank's shards: use "
                                  "weightplan.vllm_backend.trainer.start_trainer_engine(...).send_weights(), not "
                                  "trainer_send_weights (docs/vllm.md)")


def _settle(pending: BackgroundSync) -> None:
    """Let a prefetch that will not be applied end; its failure was already reported to the trainers."""
    try:
        pending.wait()
    except Exception as exc:
        log.warning("weightplan backend: prefetch of version %d not applied: %s", pending.version, str(exc)[:200])


def _side_info(side: Side | None) -> dict[str, Any]:
    d = side.destination if side else None
    return {"mode": d.mode if d else None, "reason": d.reason if d else None, "plan": side.plan.fingerprint if side else None,
            "staging_bytes": d.staging_bytes if d else 0, "version": side.receiver.version if side else None}


__all__ = ["InitInfoError", "WeightplanWeightTransferEngine"]
