"""Our stand-ins (no prime-rl code) for the prime-rl modules that do not import on a CPU host (prime_rl_bench.py)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

# What each stand-in replaces, and why (the bench reports the keys of what it applied as `stood_in`).
WHY = {
    "wandb": "an empty module with a no-op finish(): prime_rl.utils.utils imports wandb at the top (not installed "
             "here); nothing on the broadcast paths calls it",
    "prime_rl.trainer.models (package __init__ only)": "the model zoo's __init__ imports every custom model, which "
             "reaches ring_flash_attn/flash_attn/fla (CUDA only); the stand-in package keeps the real folder as its "
             "path, so prime_rl.trainer.models.base, .layers.* load from prime-rl, and it exposes the real "
             "PreTrainedModelPrimeRL",
    "prime_rl.transports.weights.nccl": "imports prime_rl.utils.client, which imports verifiers (its 0.4.0 needs "
             "renderers, anthropic, mcp, prime-sandboxes and more, not installed here), and its broadcast needs CUDA "
             "NCCL; the stand-in's NCCLWeightBroadcast refuses to be built (the package __init__ imports the name)",
}


class NCCLWeightBroadcast:
    """Placeholder for prime-rl's NCCL broadcast (CUDA only): refuses to be built."""

    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError("prime-rl's NCCL weight broadcast is stood in on this CPU host "
                           "(testing/prime_rl_stand_ins.py)")


def apply(src: Path) -> list[str]:
    """Register the stand-ins for the prime-rl sources in `src` (its `src` folder) before anything imports them;
    returns what was stood in (keys of WHY). prime-rl's real modules are used wherever they import."""
    applied = []
    if importlib.util.find_spec("wandb") is None:
        wandb = types.ModuleType("wandb", "Stand-in for wandb (testing/prime_rl_stand_ins.py).")
        wandb.finish = lambda *args, **kwargs: None
        sys.modules["wandb"] = wandb
        applied.append("wandb")
    trainer = importlib.import_module("prime_rl.trainer")
    models = types.ModuleType("prime_rl.trainer.models", "Stand-in for prime-rl's model zoo __init__.")
    models.__path__ = [str(src / "prime_rl" / "trainer" / "models")]
    sys.modules[models.__name__] = models
    trainer.models = models
    models.PreTrainedModelPrimeRL = importlib.import_module("prime_rl.trainer.models.base").PreTrainedModelPrimeRL
    applied.append("prime_rl.trainer.models (package __init__ only)")
    nccl = types.ModuleType("prime_rl.transports.weights.nccl", "Stand-in for prime-rl's NCCL broadcast module.")
    nccl.NCCLWeightBroadcast = NCCLWeightBroadcast
    sys.modules[nccl.__name__] = nccl
    applied.append("prime_rl.transports.weights.nccl")
    return applied
