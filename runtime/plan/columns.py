"""One column-table type (equally long int64 columns) and the plan's tables built on it: runs, stage runs, spans."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np


class ColumnTable:
    """A frozen dataclass of equally long int64 numpy columns: one row per index.

    Columns read as attributes or by name (`table["length"]`, as the writer and the checks address them).
    """

    @classmethod
    def column_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def empty(cls):
        return cls(**{name: np.zeros(0, dtype=np.int64) for name in cls.column_names()})

    @classmethod
    def from_columns(cls, columns: Mapping[str, np.ndarray]):
        """The table of a {column name: values} mapping (extra keys ignored), as int64."""
        return cls(**{name: np.asarray(columns[name], dtype=np.int64) for name in cls.column_names()})

    @classmethod
    def concat(cls, parts: list):
        if not parts:
            return cls.empty()
        return cls(**{n: np.concatenate([getattr(p, n) for p in parts]).astype(np.int64) for n in cls.column_names()})

    def __len__(self) -> int:
        return int(getattr(self, fields(self)[0].name).shape[0])

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.column_names():
            raise KeyError(name)
        return getattr(self, name)

    def columns(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.column_names()}

    def take(self, rows):
        return type(self)(**{name: getattr(self, name)[rows] for name in self.column_names()})

    def footprint(self) -> int:
        """Bytes of memory its columns hold."""
        return sum(int(getattr(self, name).nbytes) for name in self.column_names())


@dataclass(frozen=True)
class Runs(ColumnTable):
    """Byte runs, in elements: row i < count of a run copies
    src[src_off + i*src_stride :+length] -> dst[dst_off + i*dst_stride :+length].

    A plain run has count 1 and strides 0; a strided run (count > 1) stands for `count` rows,
    each contiguous on both sides, that one table row describes (e.g. a TP column slice of every
    row of a matrix). `src`, `dest` and `wire` index the plan's sources, dests and cast chains.
    `src_rank` is the trainer rank serving the run (in the compiler, `src_off` is global until
    split_shards makes it an offset into that rank's shard). Every inference rank holding
    `dests[dest]` reads the run. Stored in the file in RUN_COLUMNS order (runtime/plan/schema.py).
    """

    src: np.ndarray
    src_off: np.ndarray
    dest: np.ndarray
    dst_off: np.ndarray
    length: np.ndarray
    wire: np.ndarray
    src_rank: np.ndarray
    count: np.ndarray
    src_stride: np.ndarray
    dst_stride: np.ndarray

    @staticmethod
    def plain(src, src_off, dest, dst_off, length, wire, src_rank) -> "Runs":
        """Runs of one row each (count 1, strides 0)."""
        columns = [np.asarray(c, dtype=np.int64) for c in (src, src_off, dest, dst_off, length, wire, src_rank)]
        n = len(columns[4])
        return Runs(*columns, np.ones(n, dtype=np.int64), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64))

    @property
    def rows(self) -> int:
        """Contiguous rows these runs stand for: the descriptors a reader posts without packing."""
        return int(self.count.sum())

    def src_end(self) -> np.ndarray:
        """One past the last source element any row reads."""
        return self.src_off + (self.count - 1) * self.src_stride + self.length

    def dst_end(self) -> np.ndarray:
        """One past the last destination element any row writes."""
        return self.dst_off + (self.count - 1) * self.dst_stride + self.length

    def expand(self, mask: np.ndarray | None = None) -> "Runs":
        """These runs (or those selected by `mask`) as plain one-row runs, rows of a run in order."""
        runs = self if mask is None else self.take(np.flatnonzero(mask))
        run = np.repeat(np.arange(len(runs)), runs.count)
        return runs.row(run, np.arange(len(run)) - np.repeat(np.cumsum(runs.count) - runs.count, runs.count))

    def row(self, run: np.ndarray, index: np.ndarray) -> "Runs":
        """Row `index[k]` of run `run[k]`, for each k, as plain runs (gathering only the columns a row needs)."""
        return Runs.plain(self.src[run], self.src_off[run] + index * self.src_stride[run], self.dest[run],
                          self.dst_off[run] + index * self.dst_stride[run], self.length[run], self.wire[run],
                          self.src_rank[run])


@dataclass(frozen=True)
class StageRuns(ColumnTable):
    """fp8 stage runs: `length` bf16 elements of trainer `src_rank`'s shard of `src` at `src_off` go to
    staging tensor `stage` at `stage_off`, copied by `quant_rank` on `side` (runtime/plan/schema.py: Side)."""

    side: np.ndarray
    src_rank: np.ndarray
    quant_rank: np.ndarray
    src: np.ndarray
    src_off: np.ndarray
    stage: np.ndarray
    stage_off: np.ndarray
    length: np.ndarray
    wire: np.ndarray


@dataclass(frozen=True)
class BlockSpans(ColumnTable):
    """fp8 block spans: blocks [first_block, first_block + n_blocks) of staging tensor `stage`, quantized on
    `side` by trainer `src_rank` (-1 on the receiver side)."""

    stage: np.ndarray
    first_block: np.ndarray
    n_blocks: np.ndarray
    side: np.ndarray
    src_rank: np.ndarray
