"""Alternate destinations of a Receiver: more sets of tensors with the destination's geometry, each a sync can fill."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..checks import check_no_aliases, check_tensors, flat_view, named_tensors
from ..errors import PlanMismatchError
from ..plan.format import Plan


def alternate_views(plan: Plan, rank: int, held: Sequence[int], first: dict[int, torch.Tensor], alternates: Sequence,
                    features: dict[str, bool]) -> list[dict[int, torch.Tensor]]:
    """Every destination set as {plan entry: flat view}: `first` (the Receiver's `destination`), then each alternate.

    An alternate holds the same names as the destination with the same shapes, dtypes and (contiguous) strides;
    no tensor of any set may share memory with another (a sync into one set would change another's bytes).
    `features` names the Receiver's options whose state is tied to one destination set (fp8 staging, fan-out,
    delta pages, derived post-load state): alternates with any of them on are refused, in one line.
    """
    if not alternates:
        return [first]
    side = f"inference rank {rank}"
    on = sorted(name for name, enabled in features.items() if enabled)
    if on:
        raise PlanMismatchError(f"{side}: alternate destinations are refused with {', '.join(on)} (their state belongs "
                                "to one destination set); give one destination")
    expected = {plan.dests[i].name: (plan.dests[i].shape, plan.dests[i].dtype) for i in held}
    sets = [first]
    for k, alternate in enumerate(alternates, start=1):
        what = f"{side} alternate destination {k}"
        given = named_tensors(alternate, set(expected))
        check_tensors(given, expected, set(expected), what)
        views = {}
        for i in held:
            entry, tensor = plan.dests[i], given[plan.dests[i].name]
            if tensor.device != first[i].device:
                raise PlanMismatchError(f"{what} tensor {entry.name!r} is on {tensor.device}, the destination's on "
                                        f"{first[i].device}; alternates need the destination's geometry and placement")
            views[i] = flat_view(entry.name, tensor, entry.shape, entry.dtype, what)
        sets.append(views)
    check_no_aliases({f"{plan.dests[i].name} (set {k})": view for k, views in enumerate(sets) for i, view in views.items()},
                     f"{side} destination")
    return sets
