"""Layouts of both sides: parse `--trainer` / `--inference` and refuse what vLLM cannot build."""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.shards import TrainerLayout
from .frontend.errors import ModelConfigError

__all__ = ["InferenceLayout", "TrainerLayout", "parse_trainer", "parse_inference"]


@dataclass(frozen=True)
class InferenceLayout:
    """vLLM serving layout: TP within a replica, `dp` replicas, optional expert parallelism."""

    tp: int = 1
    dp: int = 1
    ep: bool = False

    @property
    def ranks(self) -> int:
        return self.tp * self.dp

    def rank_coords(self, rank: int) -> tuple[int, int]:
        """(tp_rank, dp_rank) of a global inference rank, as vLLM numbers them."""
        return rank % self.tp, rank // self.tp

    @property
    def token(self) -> str:
        return f"tp{self.tp}" + (f"-dp{self.dp}" if self.dp > 1 else "") + ("-ep" if self.ep else "")

    def as_dict(self) -> dict:
        return {"tp": self.tp, "dp": self.dp, "ep": self.ep}

    def check(self, config: dict) -> None:
        """Refuse layouts vLLM cannot build, naming the constraint, before any tracing."""
        heads = config.get("num_attention_heads")
        if heads and heads % self.tp:
            raise ModelConfigError(f"inference tp={self.tp} does not divide num_attention_heads={heads}")
        kv_heads = config.get("num_key_value_heads")
        if kv_heads and kv_heads % self.tp and self.tp % kv_heads:
            raise ModelConfigError(f"inference tp={self.tp} and num_key_value_heads={kv_heads}: neither divides the other")
        experts = config.get("n_routed_experts") or config.get("num_experts")
        if self.ep:
            if not experts:
                raise ModelConfigError("inference ep needs a MoE model; this config has no experts")
            if experts % self.ranks:
                raise ModelConfigError(f"inference ep over {self.ranks} ranks does not divide the {experts} routed experts")


def parse_trainer(text: str) -> TrainerLayout:
    try:
        return TrainerLayout.parse(text)
    except ValueError as exc:
        raise ModelConfigError(str(exc)) from None


def parse_inference(text: str) -> InferenceLayout:
    """Parse `tp=T[,dp=D][,ep]`; pipeline parallelism is refused."""
    values: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if key == "ep" and not sep:
            values["ep"] = True
        elif key in ("tp", "dp") and sep and value.isdigit() and int(value) >= 1:
            values[key] = int(value)
        elif key == "pp":
            raise ModelConfigError("pipeline parallel inference layouts are not supported: plans address whole-model ranks")
        else:
            raise ModelConfigError(f"bad inference layout item {part!r} in {text!r}: expected tp=T[,dp=D][,ep]")
    return InferenceLayout(**values)
