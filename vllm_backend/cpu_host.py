"""Make every process of a CPU engine (its spawned workers too) see a CPU without AMX tiles, whatever the host has."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

# vLLM's CPU platform picks AMX attention kernels when torch reports AMX tiles; on some AMX hosts
# the standard-attention kernel then dies with SIGILL at the first generation and the MLA kernel
# refuses narrow heads (docs/vllm.md). A sitecustomize on PYTHONPATH runs in every spawned worker.
NO_AMX_SITECUSTOMIZE = "import torch.cpu\ntorch.cpu._is_amx_tile_supported = lambda: False\n"


def pin_no_amx(directory: Path, extra_paths: tuple[str, ...] = ()) -> Callable[[], None]:
    """Pin AMX off for engines started after this call, in this process and its children; returns the undo.

    Set WEIGHTPLAN_ENGINE_AMX=1 to keep the host's own kernels. `extra_paths` are prepended to PYTHONPATH
    after the pin (e.g. a repository root the workers must import from).
    """
    saved_path, saved_probe = os.environ.get("PYTHONPATH"), torch.cpu._is_amx_tile_supported

    def undo() -> None:
        torch.cpu._is_amx_tile_supported = saved_probe
        if saved_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_path

    if os.environ.get("WEIGHTPLAN_ENGINE_AMX") == "1":
        return undo
    site = Path(directory) / "no_amx_site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(NO_AMX_SITECUSTOMIZE)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *extra_paths, *filter(None, [saved_path])])
    torch.cpu._is_amx_tile_supported = lambda: False
    return undo
