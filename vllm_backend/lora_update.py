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
    previous occupant (v-2's id) is taken off the manager first, a Receiver over the slot's `[slot:slot+1]` views READs
    the adapter into it, and only then is id `lora_id_of(v)` routed to the slot (`live_patches.route_lora_id_to_slot`).
    Requests on v-1 keep being served from the other slot throughout. A failed sync leaves its slot with no id: nothing
    serves the incomplete bytes, v-1 stays served, and the next update writes the same slot.

    The Receiver joins the job at init, on `slots[0]` (the trainers' release waits only for ranks joined when it
    starts); when the next version goes into the other slot it is replaced by a Receiver over that slot, which rejoins
    under a new incarnation as the same inference rank.
    """

    def __init__(self, plan: Plan, rank: int, manager, rendezvous: Rendezvous, *, timeout: float, verify: bool,
                 slots: tuple[int, int]) -> None:
        for slot in slots:  # a slot out of range or a buffer unlike the plan's: refused before anything is written
            slot_destination(plan, manager.modules, slot)
        self.plan, self.rank, self.manager, self.rendezvous = plan, rank, manager, rendezvous
        self.timeout, self.verify, self.slots = timeout, verify, slots
        self.version: int | None = None
        self.slot_of: dict[int, int] = {}  # version -> slot, for the versions still served
        self.receiver: Receiver | None = None
        self.receiver_slot: int | None = None

    def join(self) -> "LoraSide":
        """Join the job with a Receiver over the first slot (freed first: its constants are written now)."""
        self._receive_into(self.slots[0])
        return self

    def _receive_into(self, slot: int) -> int | None:
        """Free `slot` and point this rank's Receiver at it; returns the adapter id it displaced."""
        displaced = free_lora_slot(self.manager, slot)
        self.slot_of = {v: s for v, s in self.slot_of.items() if s != slot}
        if self.receiver_slot != slot:
            self.close()
            self.receiver = Receiver(self.plan, self.rank, slot_destination(self.plan, self.manager.modules, slot),
                                     rendezvous=self.rendezvous, timeout=self.timeout, verify=self.verify,
                                     derived="caller").start()
            self.receiver_slot = slot
        return displaced

    def next_slot(self) -> int:
        if self.version is None or self.version not in self.slot_of:
            return self.slots[0]
        return self.slots[1] if self.slot_of[self.version] == self.slots[0] else self.slots[0]

    def update(self, version: int) -> dict[str, Any]:
        """Sync `version` into the free slot and serve it under `lora_id_of(version)`; returns the update's report."""
        if self.version is not None and version <= self.version:
            raise PlanMismatchError(f"LoRA version {version} is not newer than the one served, {self.version}")
        began = time.perf_counter()
        slot = self.next_slot()
        displaced = self._receive_into(slot)
        report = self.receiver.sync(version)
        route_lora_id_to_slot(self.manager, lora_id_of(version), slot, self.plan.header.inference.lora.rank)
        self.slot_of[version], self.version = slot, version
        return {"version": version, "lora_id": lora_id_of(version), "slot": slot, "displaced_lora_id": displaced,
                "transfer_s": time.perf_counter() - began, "post_process_s": 0.0, "took": report.took,
                "bytes": report.bytes, "descriptors": report.descriptors}

    def keep_routes_across_reset(self) -> None:
        """Called when vLLM ends the update (`finish_weight_update`): its LoRA reset must not unroute served versions."""
        restore_lora_routes_after_reset(self.manager, self._reroute)

    def _reroute(self) -> None:
        for version, slot in self.slot_of.items():
            route_lora_id_to_slot(self.manager, lora_id_of(version), slot, self.plan.header.inference.lora.rank)

    def info(self) -> dict[str, Any]:
        return {"mode": "lora", "reason": "adapter versions alternate between two LoRA slots",
                "plan": self.plan.fingerprint, "staging_bytes": 0, "version": self.version,
                "lora_slots": {lora_id_of(v): s for v, s in self.slot_of.items()}}

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.receiver, self.receiver_slot = None, None
