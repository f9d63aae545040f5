"""Pipeline-parallel trainers: torchtitan's split of the layers into stages, and the layout of a stage-sharded model.

Stage `s` of `--trainer pp=P,<inner>` is trainer ranks `s * n .. s * n + n - 1` (n: the inner
layout's ranks; torchtitan's mesh puts `pp` outermost), sharded within the stage by the inner
`fsdp/ep/replicas` shorthand. A layer's tensors live on the stage holding that layer; the
embedding on the first stage, everything else outside the layers (final norm, LM head, MTP
layers past `num_hidden_layers`) on the last; a tied embedding (no separate LM head tensor) on
both, as a replica per stage. An embedding's LoRA adapter (PEFT `lora_embedding_A/B`) is never
tied: it lives on the first stage only. Layers split as torchtitan's `generate_llm_fqn_per_model_part`
does with input and output weight 1: the embedding and the head each count as one layer, the
`L + 2` weighted layers are split evenly, the first `(L + 2) % P` stages taking one more.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from weightplan.runtime.layout.placements import REPLICATE, Mesh, Sharding
from weightplan.runtime.layout.shards import ShardLayout, TrainerLayout
from weightplan.runtime.layout.stages import layer_of
from .frontend.errors import ModelConfigError
from .frontend.pipeline_stages import hidden_layers

_ADAPTER = re.compile(r"\.lora_(?:embedding_)?[AB](?:\.weight)?$")  # a PEFT LoRA tensor (lora_A/B, lora_embedding_A/B)


def torchtitan_stage_sizes(layers: int, pp: int) -> list[int]:
    """Hidden layers per stage under torchtitan's rule (input and output weight 1)."""
    weighted = layers + 2
    if pp == 1:
        return [layers]
    if weighted // pp < 1:
        raise ModelConfigError(f"trainer pp={pp} is more than the model's {layers} hidden layers plus embedding and head: "
                               "a stage would be empty")
    sizes = [weighted // pp + (stage < weighted % pp) for stage in range(pp)]
    sizes[0] -= 1  # the embedding's weight
    sizes[-1] -= 1  # the final norm and head's weight
    return sizes


@dataclass(frozen=True)
class StagedTrainer:
    """`--trainer pp=P[,fsdp=N][,ep=M][,replicas=R][,pp-layers=a+b+...]`: `layers` is filled by `resolve(config)`."""

    pp: int
    inner: TrainerLayout
    explicit: tuple[int, ...] | None = None
    layers: tuple[range, ...] = ()

    @property
    def ep(self) -> int:
        return self.inner.ep

    @property
    def ranks(self) -> int:
        return self.pp * self.inner.ranks

    @property
    def token(self) -> str:
        split = "-layers" + "+".join(map(str, self.explicit)) if self.explicit else ""
        return f"pp{self.pp}{split}-{self.inner.token}"

    def resolve(self, config: dict) -> "StagedTrainer":
        """The stage layer ranges for this model config. torchtitan's split may leave the first stage only the embedding
        and the last only the final norm and head, and so may an explicit list; a middle stage without layers, a split
        torchtitan refuses, or a list that does not fit is refused."""
        total = hidden_layers(config)
        if self.explicit is not None:
            if len(self.explicit) != self.pp:
                raise ModelConfigError(f"--trainer pp-layers gives {len(self.explicit)} stages, pp={self.pp}")
            if sum(self.explicit) != total:
                raise ModelConfigError(f"--trainer pp-layers {'+'.join(map(str, self.explicit))} covers {sum(self.explicit)} "
                                       f"layers; the model has {total}: every layer must be in exactly one stage")
            sizes = list(self.explicit)
        else:
            sizes = torchtitan_stage_sizes(total, self.pp)
        empty = [s for s, n in enumerate(sizes) if n == 0 and 0 < s < self.pp - 1]
        if empty:
            raise ModelConfigError(f"trainer pp={self.pp}: stage {empty[0]} holds no layers (split {sizes}); only the first "
                                   "and last stages, which hold the embedding and the head, may hold none")
        starts = [sum(sizes[:s]) for s in range(self.pp)]
        return dataclasses.replace(self, layers=tuple(range(a, a + n) for a, n in zip(starts, sizes)))

    def stages_of(self, name: str, names: frozenset[str]) -> tuple[int, ...]:
        """The stages holding trainer tensor `name` (`names`: every trainer tensor, to tell a tied embedding)."""
        layer = layer_of(name)
        last = self.pp - 1
        if layer is not None:
            return next(((s,) for s, held in enumerate(self.layers) if layer in held), (last,))  # MTP layers: last
        if "embed" in name:
            if _ADAPTER.search(name):  # an adapter lives with its module: PEFT ties no embedding adapter to the head
                return (0,)
            tied = not any(n.startswith(("lm_head.", "output.")) for n in names)
            return (0, last) if tied and last else (0,)
        return (last,)

    def sharding_of(self, spec, names: frozenset[str]) -> Sharding:
        """Trainer tensor `spec`'s sharding over the whole trainer (`names`: every trainer tensor, see `stages_of`)."""
        if not self.layers:
            raise ValueError("StagedTrainer.sharding_of before resolve(config)")
        inner = self.inner.sharding_for(tuple(spec.shape), spec.sharding)
        stages = self.stages_of(spec.name, names)
        ranks = tuple(s * self.inner.ranks + r for s in stages for r in inner.mesh.ranks)
        if len(stages) == 1:
            return Sharding(Mesh(inner.mesh.shape, ranks), inner.placements)
        return Sharding(Mesh((len(stages), *inner.mesh.shape), ranks), (REPLICATE, *inner.placements))

    def bind(self, specs) -> ShardLayout:
        names = frozenset(s.name for s in specs)
        shardings = [self.sharding_of(spec, names) for spec in specs]
        return dataclasses.replace(ShardLayout.build(specs, shardings), token=self.token)


def parse_staged(items: dict, rest: str) -> StagedTrainer:
    """The staged layout from `pp` (and `pp-layers`) plus the inner shorthand `rest` (default `fsdp=1`)."""
    explicit = None
    if "pp-layers" in items:
        text = items["pp-layers"]
        parts = text.split("+")
        if not all(p.isascii() and p.isdigit() for p in parts):
            raise ModelConfigError(f"--trainer pp-layers={text!r}: expected layer counts joined by '+', e.g. pp-layers=2+1+1")
        explicit = tuple(int(p) for p in parts)
    try:
        pp = int(items["pp"]) if items["pp"].isascii() and items["pp"].isdigit() else 0
        if pp < 1:
            raise ValueError(f"bad --trainer item 'pp={items['pp']}': expected a number of stages 1..")
        return StagedTrainer(pp, TrainerLayout.parse(rest or "fsdp=1"), explicit)
    except ValueError as exc:
        raise ModelConfigError(str(exc)) from None
