"""Resolve `--model NAME|PATH` to a directory holding a Hugging Face config.json."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .frontend.errors import ModelConfigError

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


def load_config_json(config_dir: Path) -> dict:
    try:
        return json.loads((config_dir / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{config_dir / 'config.json'} is not valid JSON: {exc}") from None


def config_hash(config_dir: Path) -> str:
    """SHA-256 of the config's canonical JSON (key order and whitespace do not matter)."""
    canonical = json.dumps(load_config_json(config_dir), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
