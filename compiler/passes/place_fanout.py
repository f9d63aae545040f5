"""place_fanout: pick, per node, the one inference rank that pulls each replicated entry from the trainers (node-local fan-out)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from weightplan.runtime.plan.schema import Fanout
from ..ir import Program


def place_fanout(program: Program) -> Program:
    """Record `program.fanout` for `program.gpus_per_node`: every destination unit (an entry, or an fp8 tensor's
    weight and scale together) held by two or more ranks of a node is pulled by one of them, the others reading it
    from that rank over the node's link.

    Per node, units go largest first to the holder with the fewest bytes to pull so far (bytes it pulls anyway, such
    as its own experts, included): longest-processing-time order, deterministic (ties: lower entry, lower rank).
    """
    g = program.gpus_per_node
    dests = program.dests
    pairs = [(w, s) for *_, w, s in (program.quant_placement.staging if program.quant_placement else ())]
    partner = {w: s for w, s in pairs} | {s: w for w, s in pairs}
    units = [(d,) if d not in partner else (d, partner[d]) for d in range(len(dests)) if partner.get(d, d) >= d]
    load: dict[int, int] = defaultdict(int)
    shared: list[tuple[tuple[int, ...], int, dict[int, list[int]]]] = []
    for unit in units:
        nbytes = sum(dests[d].nbytes for d in unit)
        by_node: dict[int, list[int]] = defaultdict(list)
        for rank in dests[unit[0]].ranks:
            by_node[rank // g].append(rank)
        if all(len(ranks) == 1 for ranks in by_node.values()):
            for rank in dests[unit[0]].ranks:
                load[rank] += nbytes
        else:
            shared.append((unit, nbytes, by_node))
    pullers: dict[int, list[int]] = defaultdict(list)
    for unit, nbytes, by_node in sorted(shared, key=lambda u: (-u[1], u[0])):
        for node in sorted(by_node):
            puller = min(by_node[node], key=lambda r: (load[r], r))
            load[puller] += nbytes
            for d in unit:
                pullers[d].append(puller)
    first_hops = tuple((d, tuple(sorted(pullers[d]))) for d in sorted(pullers))
    return dataclasses.replace(program, fanout=Fanout(g, first_hops))
