"""merge_ranks: join per-inference-rank programs, recording identical destination tensors once."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from ..ir import Constants, Program, Runs, TensorEntry


def merge_ranks(programs: list[Program], cast_chains: tuple) -> Program:
    """One program for all inference ranks (program i is rank i; all share sources and cast chains).

    A destination tensor of rank r joins an existing entry when its name, shape, dtype and every
    run and constant into it are identical (e.g. attention weights under DP attention): the entry
    lists the ranks holding it, and its runs and constants are stored once.
    """
    entries: list[TensorEntry] = []
    by_key: dict[tuple, int] = {}
    parts, constant_parts, last_writes = [], [], {}
    for rank, program in enumerate(programs):
        last_writes = {**program.last_writes, **last_writes}
        constants = program.constants
        constant_of = [[] for _ in program.dests]
        for i, d in enumerate(constants.dest.tolist()):
            constant_of[d].append((int(constants.dst_off[i]), int(constants.length[i]), constants.values[i]))
        new = []
        runs = program.runs
        order = np.lexsort((runs.dst_off, runs.dest))
        runs = runs.take(order)
        bounds = np.searchsorted(runs.dest, np.arange(len(program.dests) + 1))
        remap = np.zeros(len(program.dests), dtype=np.int64)
        keep = np.zeros(len(runs), dtype=bool)
        for d, spec in enumerate(program.dests):
            lo, hi = bounds[d], bounds[d + 1]
            key = (spec.name, spec.shape, spec.dtype, _digest(runs, lo, hi), tuple(constant_of[d]))
            index = by_key.get(key)
            if index is None:
                index = by_key[key] = len(entries)
                entries.append(dataclasses.replace(spec, ranks=(rank,)))
                keep[lo:hi] = True
                new.append(d)
            else:
                entries[index] = dataclasses.replace(entries[index], ranks=entries[index].ranks + (rank,))
            remap[d] = index
        kept = runs.take(np.flatnonzero(keep))
        parts.append(dataclasses.replace(kept, dest=remap[kept.dest]))
        own = constants.take(np.flatnonzero(np.isin(constants.dest, new)))
        constant_parts.append(dataclasses.replace(own, dest=remap[own.dest]))
    first = programs[0]
    return dataclasses.replace(first, dests=tuple(entries), runs=Runs.concat(parts), cast_chains=cast_chains,
                               assignments=(), copies=(), constants=Constants.concat(constant_parts), last_writes=last_writes)


def _digest(runs: Runs, lo: int, hi: int) -> bytes:
    h = hashlib.sha256()
    for column in ("src", "src_off", "dst_off", "length", "wire", "count", "src_stride", "dst_stride"):
        h.update(np.ascontiguousarray(getattr(runs, column)[lo:hi]).tobytes())
    return h.digest()
