"""The backend's LoRA side: each version of a LoRA plan synced over NIXL into one of two adapter slots, alternately."""

from __future__ import annotations

import time
from typing import Any

from weightplan.runtime import Plan, PlanMismatchError, Receiver, Rendezvous
from weightplan.runtime.lora_slots import slot_destination

from .live_patches import free_lora_slot, restore_lora_routes_after_reset, route_lora_id_to_slot


def lora_id_of(version: int) -> int:
    """The vLLM adapter id (`LoRARequest.lora_int_id`) under which version `version` of the adapter is served."""
    return version


class LoraSide:
    """Writes adapter versions into two slots of vLLM's LoRA buffers in turn; requests name a version by its id.

    Version v goes into the slot that does not hold the last version written (the first into `slots[0]`): that slot's
    previous occupant (v-2's id) is taken off the manager first, the Receiver READs the adapter into the slot's
    `[slot:slot+1]` views, and only then is id `lora_id_of(v)` routed to the slot (`live_patches.route_lora_id_to_slot`).
    Requests on v-1 keep being served from the other slot throughout. A failed sync leaves its slot with no id: nothing
    serves the incomplete bytes, v-1 stays served, and the next update writes the same slot.

    One Receiver per inference rank joins the job at init and stays joined: its destination is the first slot's views
    and its alternate the second's (runtime/receiver/alternates.py), both registered with NIXL and prepared once, so an
    update is the trainer's version record, the READs and the acknowledgement, with no agent, registration or
    connection of its own.
    """

    def __init__(self, plan: Plan, rank: int, manager, rendezvous: Rendezvous, *, timeout: float, verify: bool,
                 slots: tuple[int, int]) -> None:
        # A slot out of range or a buffer unlike the plan's: refused before anything is written.
        views = [slot_destination(plan, manager.modules, slot) for slot in slots]
        self.plan, self.rank, self.manager, self.rendezvous = plan, rank, manager, rendezvous
        self.timeout, self.verify, self.slots = timeout, verify, slots
        self.version: int | None = None
        self.slot_of: dict[int, int] = {}  # version -> slot, for the versions still served
        self.receiver = Receiver(plan, rank, views[0], alternates=views[1:], rendezvous=rendezvous, timeout=timeout,
                                 verify=verify, derived="caller")
        self.restore_s: float | None = None  # the last re-routing after vLLM's LoRA reset

    def join(self) -> "LoraSide":
        """Free both slots and join the job with the Receiver over them (the plan's constants are written now)."""
        for slot in self.slots:
            free_lora_slot(self.manager, slot)
        self.receiver.start()
        return self

    def next_slot(self) -> int:
        if self.version is None or self.version not in self.slot_of:
            return self.slots[0]
        return self.slots[1] if self.slot_of[self.version] == self.slots[0] else self.slots[0]

    def update(self, version: int) -> dict[str, Any]:
        """Sync `version` into the free slot and serve it under `lora_id_of(version)`; returns the update's report."""
        if self.version is not None and version <= self.version:
            raise PlanMismatchError(f"LoRA version {version} is not newer than the one served, {self.version}")
        began, began_at = time.perf_counter(), time.time()
        slot = self.next_slot()
        displaced = free_lora_slot(self.manager, slot)
        self.slot_of = {v: s for v, s in self.slot_of.items() if s != slot}
        into = self.slots.index(slot)
        self.receiver.write_constants(into)  # vLLM may have loaded another adapter into the slot since we wrote it
        prepared = time.perf_counter()
        report = self.receiver.sync(version, into=into)
        synced = time.perf_counter()
        route_lora_id_to_slot(self.manager, lora_id_of(version), slot, self.plan.header.inference.lora.rank)
        self.slot_of[version], self.version = slot, version
        done = time.perf_counter()
        return {"version": version, "lora_id": lora_id_of(version), "slot": slot, "displaced_lora_id": displaced,
                "transfer_s": done - began, "post_process_s": 0.0, "took": report.took,
                "bytes": report.bytes, "descriptors": report.descriptors,
                "breakdown": {"free_slot_s": prepared - began, "wait_s": report.wait_seconds,
                              "connect_s": report.connect_seconds,
                              "read_s": report.seconds - report.wait_seconds - report.connect_seconds,
                              "sync_s": synced - prepared, "route_s": done - synced},
                "began_at": began_at, "ended_at": began_at + (done - began)}  # wall clock, to split the RPC's cost

    def keep_routes_across_reset(self) -> None:
        """Called when vLLM ends the update (`finish_weight_update`): its LoRA reset must not unroute served versions."""
        restore_lora_routes_after_reset(self.manager, self._reroute)

    def _reroute(self) -> None:
        began = time.perf_counter()
        for version, slot in self.slot_of.items():
            route_lora_id_to_slot(self.manager, lora_id_of(version), slot, self.plan.header.inference.lora.rank)
        self.restore_s = time.perf_counter() - began

    def info(self) -> dict[str, Any]:
        return {"mode": "lora", "reason": "adapter versions alternate between two LoRA slots",
                "plan": self.plan.fingerprint, "staging_bytes": 0, "version": self.version,
                "lora_slots": {lora_id_of(v): s for v, s in self.slot_of.items()}, "restore_s": self.restore_s,
                "incarnation": self.receiver.incarnation}  # one Receiver for the job's life: the same at every update

    def close(self) -> None:
        self.receiver.close()
