"""Serve a live trainer module (FSDP2 / DTensor parameters): its layout checked against the plan, its storages re-checked at every publish.

`LiveSender(plan, rank, module, rendezvous=...)` derives the trainer layout from the module's
DTensors (the same description `write_trainer_layout` writes) and refuses a plan compiled for
another layout; `start()` (or `with`) gives a started `Sender` the local shard tensors. At every
`publish` it checks that the tensors it registered are still the module's (data pointer, shape,
stride, dtype); if a checkpoint load or a re-sharding replaced them, it re-checks the layout and
starts a new `Sender` on the new storages (a new incarnation: receivers reconnect at their next
sync), or raises `PlanMismatchError` if the layout changed. See docs/trainer.md.
"""

from __future__ import annotations

import logging

import torch

from ..errors import LayoutError, PlanMismatchError, WeightplanError
from ..layout.layout_file import TrainerLayoutFile, describe_layout, parse_trainer_layout
from ..layout.module_tensors import trainer_tensors
from ..layout.placements import Box
from ..layout.shards import rank_boxes
from ..plan.format import Plan
from .sender import Sender

log = logging.getLogger("weightplan.runtime")


def module_layout(module: torch.nn.Module, *, world_size: int | None = None, stage: bool = False) -> TrainerLayoutFile:
    """The trainer layout of a live module (with `stage`, a pipeline stage's), checked like a layout file (LayoutError
    names a defect)."""
    return parse_trainer_layout(describe_layout(trainer_tensors(module), world_size=world_size), "of the live module",
                                stage=stage)


def _box_text(box: Box | None) -> str:
    return "nothing" if box is None else "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def check_layout(plan: Plan, layout: TrainerLayoutFile, rank: int = 0) -> None:
    """Refuse a plan compiled for another trainer layout: PlanMismatchError naming the first tensor and placement that differ.

    For a pipelined trainer's plan (`trainer.pp`), the module is trainer `rank`'s stage: it must hold exactly the
    tensors the plan places on that stage, laid out as the plan has them on the stage's ranks."""
    world = plan.header.src_ranks
    hint = ("compile the plan from this module's layout (write_trainer_layout(module, FILE), then "
            "compile-plan --trainer-layout FILE)")
    if layout.world_size != world:
        raise PlanMismatchError(f"the module's trainer world has {layout.world_size} ranks, the plan was compiled for "
                                f"{world} trainer ranks; {hint}")
    table = plan.shard_layout
    ranks = range(world)
    names = [e.name for e in plan.sources]
    if plan.header.trainer.pp:
        ranks = _stage_ranks(plan, rank)
        on_stage = _stage_names(plan, ranks)
        names = [n for n in names if n in on_stage]
        _check_stage(plan, layout, rank, on_stage)
    missing = [n for n in names if n not in layout.tensors]
    if missing:
        raise PlanMismatchError(f"the plan's trainer tensor {missing[0]!r} is not in the module"
                                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; the plan is for "
                                f"another model or --trainer-format, or a wrapper renamed it; {hint}")
    extra = [n for n in layout.tensors if n not in set(names)]
    if extra:
        raise PlanMismatchError(f"the module's tensor {extra[0]!r} is not a trainer tensor of the plan"
                                f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}; {hint}")
    for i, entry in enumerate(plan.sources):
        if entry.name not in layout.tensors:  # another pipeline stage's tensor
            continue
        mine = layout.tensors[entry.name]
        if mine.shape != tuple(entry.shape):
            raise PlanMismatchError(f"trainer tensor {entry.name!r} has global shape {list(mine.shape)} in the module, the "
                                    f"plan expects {list(entry.shape)}; {hint}")
        if mine.dtype != entry.dtype:
            raise PlanMismatchError(
                f"trainer tensor {entry.name!r} is {mine.dtype} in the module, the plan expects {entry.dtype}. FSDP2's "
                "sharded parameters are the masters (MixedPrecisionPolicy(param_dtype=...) only casts the all-gathered "
                f"copies): compile with --trainer-dtype {'fp32' if mine.dtype == 'float32' else 'bf16'}")
        boxes = rank_boxes(mine.sharding, mine.shape, world)
        planned = table.classes[table.of[i]]
        for rank, (have, want) in enumerate(zip(boxes, planned)):
            if rank in ranks and have != want:
                placements = ", ".join(map(str, mine.sharding.placements))
                mesh = mine.sharding.mesh
                raise PlanMismatchError(
                    f"trainer tensor {entry.name!r}: the module places it ({placements}) on mesh {list(mesh.shape)} of "
                    f"ranks {list(mesh.ranks)}, so trainer rank {rank} holds {_box_text(have)}; the plan (trainer layout "
                    f"{table.token}) has rank {rank} holding {_box_text(want)}; {hint}")


def _stage_ranks(plan: Plan, rank: int) -> range:
    """The trainer ranks of `rank`'s pipeline stage in a pipelined trainer's plan."""
    per_stage = plan.header.src_ranks // plan.header.trainer.pp
    stage = plan.header.trainer.stage_of(rank, plan.header.src_ranks)
    return range(stage * per_stage, (stage + 1) * per_stage)


def _stage_names(plan: Plan, ranks: range) -> set[str]:
    """The trainer tensors a pipeline stage (its ranks) holds some of."""
    table = plan.shard_layout
    return {e.name for i, e in enumerate(plan.sources) if any(table.classes[table.of[i]][r] is not None for r in ranks)}


def _check_stage(plan: Plan, layout: TrainerLayoutFile, rank: int, names: set[str]) -> None:
    """Refuse, in one line, a stage module run as a trainer rank of another pipeline stage."""
    held = set(layout.tensors)
    if held == names:
        return
    pp = plan.header.trainer.pp
    stage = plan.header.trainer.stage_of(rank, plan.header.src_ranks)
    for other in range(pp):
        ranks = _stage_ranks(plan, other * plan.header.src_ranks // pp)
        if held == _stage_names(plan, ranks):
            raise PlanMismatchError(f"trainer rank {rank} is pipeline stage {stage} of {pp} in the plan, but the module "
                                    f"holds stage {other}'s tensors; run it as a trainer rank of stage {other} "
                                    f"(ranks {ranks.start}..{ranks.stop - 1})")
    extra = sorted(held - names)
    if extra:
        raise PlanMismatchError(f"trainer rank {rank} is pipeline stage {stage} of {pp} in the plan, which does not place "
                                f"the module's tensor {extra[0]!r} on that stage; compile the plan with this trainer's "
                                "--trainer pp=... split (pp-layers) or from its layout")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    local = getattr(tensor, "to_local", None)
    return (local() if callable(local) else tensor).detach()


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device)


class LiveSender:
    """A `Sender` for trainer `rank` of `plan` serving a live module's shards; re-checked at every publish.

    Construction refuses (PlanMismatchError, nothing registered) a plan whose trainer layout is not
    the module's; `start()` registers the shards (as `Sender.start`), `close()` releases them, and the
    LiveSender is a context manager doing both. `publish(v)` first compares the module's current local tensors with the ones
    registered: unchanged, it publishes; replaced (same layout), it releases the pending version,
    retires the old Sender and registers the new storages as a new Sender incarnation (counted in
    `reregistered`); with another layout it raises PlanMismatchError and publishes nothing.
    Other keyword arguments go to `Sender`. Attributes not defined here are the current Sender's.
    """

    def __init__(self, plan: Plan, rank: int, module: torch.nn.Module, **sender_kwargs):
        self.plan, self.rank, self.module, self._kwargs = plan, rank, module, sender_kwargs
        self.reregistered = 0
        self.sender: Sender | None = None
        self._locals: dict[str, torch.Tensor] | None = self._checked_locals()

    def start(self) -> "LiveSender":
        """Register the module's shards and publish this rank's info (Sender.start); returns self."""
        if self._locals is None:
            raise WeightplanError(f"trainer rank {self.rank}: this LiveSender was started already")
        self.sender, self._locals = self._start(self._locals), None
        return self

    def __enter__(self) -> "LiveSender":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _checked_locals(self) -> dict[str, torch.Tensor]:
        """The module's local shards by plan name, after checking its layout against the plan."""
        tensors = trainer_tensors(self.module)
        try:
            layout = module_layout(self.module, stage=bool(self.plan.header.trainer.pp))
        except LayoutError as exc:
            raise PlanMismatchError(f"trainer rank {self.rank}: {exc}") from None
        check_layout(self.plan, layout, self.rank)
        return {name: _local(t) for name, t in tensors.items()}

    def _start(self, tensors: dict[str, torch.Tensor]) -> Sender:
        sender = Sender(self.plan, self.rank, tensors, **self._kwargs).start()
        self._registered = {name: _storage_key(t) for name, t in tensors.items()}
        return sender

    def _current(self) -> dict[str, torch.Tensor]:
        return {name: _local(t) for name, t in trainer_tensors(self.module).items()}

    def changed(self) -> list[str]:
        """Plan tensors whose storage, shape, stride or dtype is no longer the one registered (cheap: no copies)."""
        current = self._current()
        return [n for n, key in self._registered.items() if n not in current or _storage_key(current[n]) != key]

    def publish(self, version: int) -> None:
        """Publish `version` from the module's current storages (re-registering them if they were replaced)."""
        if self.sender is None:
            raise WeightplanError(f"trainer rank {self.rank}: start() the LiveSender before publishing")
        changed = self.changed()
        if changed:
            tensors = self._checked_locals()  # PlanMismatchError if the layout itself changed
            log.warning("trainer rank %d: %d tensors were reallocated (e.g. %r) since they were registered; "
                        "registering the new storages", self.rank, len(changed), changed[0])
            self._retire()
            self.sender = self._start(tensors)
            self.reregistered += 1
        self.sender.publish(version)

    def release(self, version: int, timeout: float | None = None):
        return self.sender.release(version, timeout)

    def _retire(self) -> None:
        """Let receivers finish the pending version, then drop the old Sender and its registrations."""
        old, self.sender = self.sender, None
        if old._pending is not None:
            old.release(old._pending)
        old.close()

    def close(self) -> None:
        if self.sender is not None:
            self._retire()

    def __getattr__(self, name: str):
        sender = self.__dict__.get("sender")
        if sender is None:
            raise AttributeError(name)
        return getattr(sender, name)
