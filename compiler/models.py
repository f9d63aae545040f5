"""Resolve `--model NAME|PATH` to a directory holding a Hugging Face config.json."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from weightplan.runtime.files import read_json_file
from .errors import ModelConfigError

CONFIG_ROOT = Path(__file__).parent / "configs"


def known_models() -> list[str]:
    return sorted(p.parent.name for p in CONFIG_ROOT.glob("*/config.json"))


def resolve_model(model: str) -> tuple[str, Path]:
    """Return (model name used in plan paths, config directory) for a shipped name or a path."""
    shipped = CONFIG_ROOT / model / "config.json"
    if "/" not in model and shipped.is_file():
        return model, shipped.parent
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelConfigError(f"{path} has no config.json; pass a directory holding a Hugging Face config.json")
        return path.resolve().name, path.resolve()
    if path.is_file() and path.name == "config.json":
        return path.resolve().parent.name, path.resolve().parent
    raise ModelConfigError(
        f"unknown model {model!r}: not a shipped model and not a directory. Known models: {', '.join(known_models())}"
    )


# Fields the compiler reads itself (layout checks): each must be a non-negative integer when present, at most its bound
# (far above any real model's; building a model of more layers or experts than this would take unbounded time and memory).
_INTEGER_FIELDS = {"num_attention_heads": 1 << 16, "num_key_value_heads": 1 << 16, "n_routed_experts": 1 << 16,
                   "num_experts": 1 << 16, "num_local_experts": 1 << 16, "hidden_size": 1 << 20, "num_hidden_layers": 1 << 12,
                   "vocab_size": 1 << 24}


def load_config_json(config_dir: Path) -> dict:
    """The config as a dict; ModelConfigError naming the file (and field) if it is not a JSON object of sane fields."""
    path = config_dir / "config.json"
    config = read_json_file(path, ModelConfigError, "model config")
    if not isinstance(config, dict):
        raise ModelConfigError(f"{path} holds a JSON {type(config).__name__}, expected an object of config fields")
    for field, bound in _INTEGER_FIELDS.items():
        value = config.get(field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= bound):
            raise ModelConfigError(f"{path}: field {field!r} is {repr(value)[:40]}, expected an integer in 0..{bound}")
    return config


def config_hash(config_dir: Path) -> str:
    """SHA-256 of the config's canonical JSON (key order and whitespace do not matter)."""
    canonical = json.dumps(load_config_json(config_dir), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
