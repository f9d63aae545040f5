"""Event simulation of tasks sharing resources max-min fairly (progressive filling), with dependencies between tasks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from weightplan.runtime.errors import WeightplanError


@dataclass(frozen=True)
class Resource:
    name: str
    capacity: float  # work units (bytes) per second


@dataclass(frozen=True)
class Task:
    """`work` units that flow through every resource in `resources` at one common rate, once every task of `after` finished."""

    name: str
    phase: str
    rank: str
    work: float
    resources: tuple[int, ...]
    after: tuple[int, ...] = ()


@dataclass(frozen=True)
class Schedule:
    start: np.ndarray  # seconds, per task
    finish: np.ndarray
    busy: np.ndarray  # seconds each resource was used at full capacity (work through it / capacity)
    limited_by: np.ndarray  # per task, the resource that bounded its rate for the longest time
    makespan: float
    events: int


def simulate(resources: list[Resource], tasks: list[Task]) -> Schedule:
    """Run every task as early as its dependencies allow; while tasks run, each resource's capacity is
    shared max-min fairly among the tasks using it (water-filling), recomputed whenever a task
    starts or finishes. Exact up to floating point for piecewise-constant rates."""
    n, n_res = len(tasks), len(resources)
    capacity = np.array([r.capacity for r in resources], dtype=np.float64)
    work = np.array([t.work for t in tasks], dtype=np.float64)
    pair_task = np.array([i for i, t in enumerate(tasks) for _ in t.resources], dtype=np.int64)
    pair_res = np.array([r for t in tasks for r in t.resources], dtype=np.int64)
    if n and (np.bincount(pair_task, minlength=n) == 0).any():
        raise WeightplanError("simulate: every task needs at least one resource")
    waiting = np.array([len(set(t.after)) for t in tasks], dtype=np.int64)
    dependents: list[list[int]] = [[] for _ in range(n)]
    for i, t in enumerate(tasks):
        for j in set(t.after):
            dependents[j].append(i)
    start = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    remaining = work.copy()
    busy = np.zeros(n_res)
    limited: dict[tuple[int, int], float] = {}
    now, events = 0.0, 0
    running = np.zeros(n, dtype=bool)

    def begin(ready: list[int]) -> None:
        while ready:
            i = ready.pop()
            start[i] = now
            if work[i] <= 0:
                finish[i] = now
                ready.extend(_release(i, waiting, dependents))
            else:
                running[i] = True

    begin([i for i in range(n) if waiting[i] == 0])
    while running.any():
        events += 1
        rate, bound = _max_min_rates(running, pair_task, pair_res, capacity, n)
        active = np.flatnonzero(running)
        dt = float(np.min(remaining[active] / rate[active]))
        used = np.bincount(pair_res, weights=np.where(running[pair_task], rate[pair_task], 0.0), minlength=n_res)
        busy += used / capacity * dt
        for i in active.tolist():
            limited[(i, int(bound[i]))] = limited.get((i, int(bound[i])), 0.0) + dt
        remaining[active] -= rate[active] * dt
        now += dt
        done = active[remaining[active] <= 1e-9 * np.maximum(work[active], 1.0)]
        remaining[done] = 0.0
        running[done] = False
        finish[done] = now
        ready: list[int] = []
        for i in done.tolist():
            ready.extend(_release(i, waiting, dependents))
        begin(ready)
    if np.isnan(finish).any():
        stuck = tasks[int(np.flatnonzero(np.isnan(finish))[0])].name
        raise WeightplanError(f"simulate: task {stuck!r} never started: its dependencies form a cycle")
    limited_by = np.full(n, -1, dtype=np.int64)
    longest = np.zeros(n)
    for (i, r), seconds in limited.items():
        if seconds > longest[i]:
            longest[i], limited_by[i] = seconds, r
    for i in np.flatnonzero(limited_by < 0).tolist():  # zero-work tasks: name their first resource
        limited_by[i] = tasks[i].resources[0]
    return Schedule(start, finish, busy, limited_by, float(finish.max(initial=0.0)), events)


def _release(i: int, waiting: np.ndarray, dependents: list[list[int]]) -> list[int]:
    ready = []
    for j in dependents[i]:
        waiting[j] -= 1
        if waiting[j] == 0:
            ready.append(j)
    return ready


def _max_min_rates(running, pair_task, pair_res, capacity, n) -> tuple[np.ndarray, np.ndarray]:
    """Progressive filling: raise every unfrozen task's rate together; when a resource is full,
    freeze the tasks through it. Returns (rate per task, the resource that froze it)."""
    rate = np.zeros(n)
    bound = np.full(n, -1, dtype=np.int64)
    cap = capacity.copy()
    unfrozen = running.copy()
    while unfrozen.any():
        live = unfrozen[pair_task]
        counts = np.bincount(pair_res[live], minlength=len(cap))
        share = np.where(counts > 0, cap / np.maximum(counts, 1), np.inf)
        level = share.min()
        tight = share <= level * (1 + 1e-12)
        hit = live & tight[pair_res]
        tasks = np.unique(pair_task[hit])
        bound[pair_task[hit]] = pair_res[hit]
        rate[tasks] = level
        unfrozen[tasks] = False
        newly = np.zeros(n, dtype=bool)
        newly[tasks] = True
        cap -= np.bincount(pair_res[newly[pair_task]], weights=np.full(int(newly[pair_task].sum()), level), minlength=len(cap))
        cap = np.maximum(cap, 0.0)
    return rate, bound
