"""Second hops of a fan-out plan: which whole destination entries an inference rank reads from, or serves to, its node's peers."""

from __future__ import annotations

from ..plan.format import Plan
from .ranks import check_dst_rank


def second_hops(plan: Plan, rank: int) -> dict[int, tuple[int, ...]]:
    """{puller rank: destination entries} that inference `rank` holds but reads whole from that puller of its node."""
    check_dst_rank(plan, rank)
    if plan.fanout is None:
        return {}
    hops: dict[int, list[int]] = {}
    node = plan.fanout.node_of(rank)
    for dest, pullers in plan.fanout.first_hops:
        if rank in plan.dests[dest].ranks and rank not in pullers:
            (puller,) = (p for p in pullers if plan.fanout.node_of(p) == node)
            hops.setdefault(puller, []).append(dest)
    return {p: tuple(d) for p, d in sorted(hops.items())}


def served_hops(plan: Plan, rank: int) -> dict[int, tuple[int, ...]]:
    """{peer rank: destination entries} that peers of inference `rank`'s node read whole from it after its first hop."""
    check_dst_rank(plan, rank)
    if plan.fanout is None:
        return {}
    served: dict[int, list[int]] = {}
    node = plan.fanout.node_of(rank)
    for dest, pullers in plan.fanout.first_hops:
        if rank in pullers:
            for peer in plan.dests[dest].ranks:
                if peer not in pullers and plan.fanout.node_of(peer) == node:
                    served.setdefault(peer, []).append(dest)
    return {p: tuple(d) for p, d in sorted(served.items())}


def served_entries(plan: Plan, rank: int) -> tuple[int, ...]:
    """The destination entries some peer reads from inference `rank`, ascending."""
    return tuple(sorted({d for dests in served_hops(plan, rank).values() for d in dests}))
