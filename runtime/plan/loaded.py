"""A loaded plan: its header, run columns and the views executors derive from them (the pulling form, shard boxes)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ..layout.placements import Box
from ..layout.shards import ShardLayout
from .columns import BlockSpans, Runs, StageRuns
from .header import PlanHeader
from .schema import DTYPE_SIZES, TensorEntry


def _from_header(name: str) -> property:
    """A read-only Plan attribute that is the header's field `name`."""
    return property(lambda plan: getattr(plan.header, name), doc=f"The header's `{name}`.")


@dataclass(frozen=True)
class Plan:
    """A loaded plan: its header (the tensor tables among it) and run columns (elements, not bytes).

    `table` holds the runs as stored (strided runs included); `runs` the same runs as contiguous
    one-row runs, which is what executors move. `stage` and `spans` are the fp8 tables.
    """

    header: PlanHeader
    table: Runs = field(repr=False)
    stage: StageRuns = field(default_factory=StageRuns.empty, repr=False)
    spans: BlockSpans = field(default_factory=BlockSpans.empty, repr=False)

    # The tensor tables and the fingerprint live in the header (typed there); a plan reads them through.
    sources = _from_header("sources")
    dests = _from_header("dests")
    cast_chains = _from_header("cast_chains")
    staging = _from_header("staging")
    constants = _from_header("constants")
    derived = _from_header("derived")
    fanout = _from_header("fanout")
    fingerprint = _from_header("fingerprint")

    @property
    def unloaded(self) -> tuple[TensorEntry, ...]:
        """Parameters vLLM's load_weights never writes (header `inference.unloaded`): the plan leaves them alone."""
        return self.header.inference.unloaded

    @cached_property
    def pulling(self) -> "Plan":
        """The plan as the trainers serve it: each destination and staging entry held by the ranks that pull it from
        the trainers (with fan-out, one per node; the others read it from their node's puller). Without fan-out, itself."""
        if self.fanout is None:
            return self
        pullers = self.fanout.pullers()
        dests = tuple(dataclasses.replace(e, ranks=pullers.get(i, e.ranks)) for i, e in enumerate(self.dests))
        staging = tuple(dataclasses.replace(e, ranks=pullers.get(e.weight, e.ranks)) for e in self.staging)
        return dataclasses.replace(self, header=dataclasses.replace(self.header, dests=dests, staging=staging, fanout=None))

    @cached_property
    def shard_layout(self) -> ShardLayout:
        """The box of each source every trainer rank holds (see runtime/layout/shards.py)."""
        return ShardLayout.from_header(self.header.trainer, [(e.name, e.box_class) for e in self.sources])

    def shard_box(self, source: int, rank: int) -> Box | None:
        """The box of source `source` that trainer `rank` holds; None if the rank is not in its mesh."""
        return self.shard_layout.box(source, rank)

    def local_shape(self, source: int, rank: int) -> tuple[int, ...]:
        """Shape of trainer `rank`'s local shard of source `source`; (0,) off its mesh, as DTensor reports."""
        box = self.shard_box(source, rank)
        return (0,) if box is None else tuple(b - a for a, b in box)

    @cached_property
    def runs(self) -> Runs:
        """Every row of every run, in stored order (rows of a strided run consecutive), as plain runs."""
        return self.table.expand()

    @property
    def n_runs(self) -> int:
        """Rows (contiguous runs) in the plan; `n_stored_runs` counts table entries."""
        return int(self.table["count"].sum())

    @property
    def n_stored_runs(self) -> int:
        return int(self.table["count"].shape[0])

    def wire_itemsize(self) -> np.ndarray:
        """Bytes per element on the wire (the destination dtype) for each row of `runs`."""
        return self._sizes()[self.runs["wire"]]

    def stored_itemsize(self) -> np.ndarray:
        """Bytes per element on the wire for each entry of `table`."""
        return self._sizes()[self.table["wire"]]

    def _sizes(self) -> np.ndarray:
        return np.array([DTYPE_SIZES[chain[-1]] for chain in self.cast_chains] or [0], dtype=np.int64)
