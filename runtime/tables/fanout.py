"""Second hops of a fan-out plan: which whole destination entries an inference rank reads from, or serves to, its node's peers."""

from __future__ import annotations

from ..plan.format import Plan
from .ranks import check_dst_rank


def hops(plan: Plan) -> list[tuple[int, int, int]]:
    """Every second hop of `plan` as (peer, puller, destination entry): `peer` holds the entry without pulling it and
    reads it whole from `puller`, the rank of its node that pulled it from the trainers. Empty without fan-out."""
    if plan.fanout is None:
        return []
    node = plan.fanout.node_of
    out = []
    for dest, pullers in plan.fanout.first_hops:
        by_node = {node(p): p for p in pullers}
        out += [(peer, by_node[node(peer)], dest) for peer in plan.dests[dest].ranks if peer not in pullers]
    return out


def second_hops(plan: Plan, rank: int) -> dict[int, tuple[int, ...]]:
    """{puller rank: destination entries} that inference `rank` holds but reads whole from that puller of its node."""
    check_dst_rank(plan, rank)
    return _grouped((puller, dest) for peer, puller, dest in hops(plan) if peer == rank)


def served_hops(plan: Plan, rank: int) -> dict[int, tuple[int, ...]]:
    """{peer rank: destination entries} that peers of inference `rank`'s node read whole from it after its first hop."""
    check_dst_rank(plan, rank)
    return _grouped((peer, dest) for peer, puller, dest in hops(plan) if puller == rank)


def served_entries(plan: Plan, rank: int) -> tuple[int, ...]:
    """The destination entries some peer reads from inference `rank`, ascending."""
    return tuple(sorted({d for dests in served_hops(plan, rank).values() for d in dests}))


def _grouped(pairs) -> dict[int, tuple[int, ...]]:
    """{rank: its entries in plan order} of (rank, entry) pairs, ranks ascending."""
    out: dict[int, list[int]] = {}
    for rank, dest in pairs:
        out.setdefault(rank, []).append(dest)
    return {rank: tuple(dests) for rank, dests in sorted(out.items())}
