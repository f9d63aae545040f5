"""The plan's schema: tensor entries, the fp8 sides, derived post-load items, column names and dtype sizes."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from ..dtypes import DTYPE_SIZES  # part of the schema; defined below it so that runtime/layout imports it downward

CONSTANT_COLUMNS = ("dest", "dst_off", "length", "value")  # a header "constants" row
ROW_COLUMNS = ("src_rank", "src", "src_off", "dest", "dst_off", "length", "wire")  # one contiguous row of a run
RUN_COLUMNS = ROW_COLUMNS + ("count", "src_stride", "dst_stride")  # the stored run table, in file order
# fp8_per_block: bf16 runs from trainer rank src_rank's shard into a staging tensor, and spans of
# 128x128 blocks quantized on one side (see Side). A stage run's quant_rank is the trainer rank that
# copies it (src_rank on the sender side, -1 on the receiver side); a span's src_rank is its
# quantizing trainer rank (-1 on the receiver side).
STAGE_COLUMNS = ("side", "src_rank", "quant_rank", "src", "src_off", "stage", "stage_off", "length", "wire")
SPAN_COLUMNS = ("stage", "first_block", "n_blocks", "side", "src_rank")


class Quant(str, enum.Enum):
    """The quantizations a plan may name (its header's `quant`): the one list of them; the compiler has a mode for each."""

    NONE = "none"
    FP8_PER_BLOCK = "fp8_per_block"


class Side(enum.IntEnum):
    """Who quantizes a block span (and copies a stage run) of an fp8_per_block plan; stored as the `side` column."""

    SENDER = 0  # trainer src_rank quantizes blocks only it holds, from its own shard, and serves fp8
    RECEIVER = 1  # every inference rank holding the tensor pulls the bf16 and quantizes it
    GATHER = 2  # trainer quant_rank reads the bf16 its peers hold once, quantizes and serves fp8 to every holder


SENDER, RECEIVER, GATHER = Side  # plain names for numpy comparisons (IntEnum members compare as ints)
TRAINER_SIDES = (Side.SENDER, Side.GATHER)  # blocks a trainer rank quantizes and serves as fp8


def dtype_name(dtype) -> str:
    """A torch dtype's plan name (torch.bfloat16 -> "bfloat16")."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorEntry:
    """A named tensor of one side of a plan, as the compiler builds it and the reader returns it.

    A trainer tensor carries its `sharding` ("dense" or "expert", runtime/layout/shards.py) while
    compiling and, in a loaded plan, its `box_class`: its row of the header's trainer box tables. A
    destination entry carries the inference `ranks` holding this exact tensor (replicas share one entry).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    sharding: str = "dense"
    ranks: tuple[int, ...] = (0,)
    box_class: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]

    def source_row(self) -> list:
        """The header's "sources" row: [name, shape, dtype, box class]."""
        return [self.name, list(self.shape), self.dtype, self.box_class]

    def dest_row(self) -> list:
        """The header's "dests" row: [name, shape, dtype, inference ranks]."""
        return [self.name, list(self.shape), self.dtype, list(self.ranks)]

    @staticmethod
    def from_source_row(row) -> "TensorEntry":
        return TensorEntry(row[0], tuple(row[1]), row[2], box_class=row[3])

    @staticmethod
    def from_dest_row(row) -> "TensorEntry":
        return TensorEntry(row[0], tuple(row[1]), row[2], ranks=tuple(row[3]))


@dataclass(frozen=True)
class StagingEntry:
    """A bf16 tensor vLLM's loaders write and process_weights_after_loading quantizes into dests weight + scale."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    ranks: tuple[int, ...]
    weight: int
    scale: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def row(self) -> list:
        """The header's "staging" row: [name, shape, dtype, inference ranks, weight entry, scale entry]."""
        return [self.name, list(self.shape), self.dtype, list(self.ranks), self.weight, self.scale]

    @staticmethod
    def from_row(row) -> "StagingEntry":
        return StagingEntry(row[0], tuple(row[1]), row[2], tuple(row[3]), int(row[4]), int(row[5]))


@dataclass(frozen=True)
class ConstantRun:
    """Elements [dst_off, dst_off + length) of destination entry `dest` hold `value` (cast to its dtype); never on the wire."""

    dest: int
    dst_off: int
    length: int
    value: float | int | bool

    def row(self) -> list:
        """The header's "constants" row: [dest, dst_off, length, value]."""
        return [self.dest, self.dst_off, self.length, self.value]


@dataclass(frozen=True)
class DerivedItem:
    """State vLLM derives from loaded parameters and keeps outside them (e.g. MLA's W_UK/W_UV absorbed from kv_b_proj).

    `module` is recomputed from the parameters `reads` by `where` ("receiver": the inference rank
    after each sync). In the header it is the row [module, what, reads, where].
    """

    module: str
    what: str
    reads: tuple[str, ...]
    where: str

    RECEIVER = "receiver"

    def row(self) -> list:
        """The header's "derived" row: [module, what, reads, where]."""
        return [self.module, self.what, list(self.reads), self.where]

    @staticmethod
    def from_row(row) -> "DerivedItem":
        module, what, reads, where = row
        return DerivedItem(module, what, tuple(reads), where)


@dataclass(frozen=True)
class Fanout:
    """Node-local fan-out (`--inference ...,gpus-per-node=G`): for each replicated destination entry, the inference ranks
    that pull it from the trainers, one per node holding it (`first_hops`: (dest, pullers ascending), by dest).

    Every other rank holding the entry reads it whole from the puller of its node once that puller's first hop landed
    in this version (a second hop). Ranks are numbered node by node: rank r sits on node r // gpus_per_node. The fp8
    weight and scale of one staging tensor have the same pullers (the puller quantizes; peers read the result).
    """

    gpus_per_node: int
    first_hops: tuple[tuple[int, tuple[int, ...]], ...]

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def pullers(self) -> dict[int, tuple[int, ...]]:
        """{dest index: the ranks pulling it from the trainers} for every fanned-out entry."""
        return dict(self.first_hops)

    def row(self) -> dict:
        """The header's "fanout" object: {"gpus_per_node": G, "first_hops": [[dest, [ranks...]], ...]}."""
        return {"gpus_per_node": self.gpus_per_node, "first_hops": [[d, list(p)] for d, p in self.first_hops]}

    @staticmethod
    def from_row(obj) -> "Fanout":
        return Fanout(obj["gpus_per_node"], tuple((d, tuple(p)) for d, p in obj["first_hops"]))
