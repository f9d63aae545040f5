"""The compile's garbage collection: the cyclic GC paused, and dropped vLLM models freed without rescanning what lives on."""

from __future__ import annotations

import contextlib
import gc

_frozen_here = [False]  # whether collect_dropped froze the survivors of this compile (gc_paused unfreezes them)


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic GC: the IR is acyclic and large, and gen-2 scans of it dominate otherwise."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _frozen_here[0]:
            gc.unfreeze()
            _frozen_here[0] = False
        if was_enabled:
            gc.enable()


def collect_dropped() -> None:
    """Free dropped models (vLLM modules form cycles); then freeze what survives, so later calls scan only newer objects.

    The first call inside `gc_paused` freezes everything alive then (vLLM's modules, the trainer table):
    a full collection per rank rescanned them all (about 0.6 s each for GLM-5.2). A process that froze
    objects itself is left as it is, and every call is then a full collection.
    """
    gc.collect()
    if not gc.isenabled() and not _frozen_here[0] and gc.get_freeze_count() == 0:
        gc.freeze()
        _frozen_here[0] = True
