"""gc_pause: dropped models freed inside a paused GC, survivors frozen once and unfrozen at the end."""

from __future__ import annotations

import gc
import weakref

from weightplan.compiler.gc_pause import collect_dropped, gc_paused


class _Cycle:
    def __init__(self):
        self.me = self


def test_dropped_cycles_are_freed_and_survivors_frozen_only_while_paused():
    was_enabled = gc.isenabled()
    kept = _Cycle()
    with gc_paused():
        assert not gc.isenabled()
        first = _Cycle()
        alive = weakref.ref(first)
        del first
        collect_dropped()
        assert alive() is None
        assert gc.get_freeze_count() > 0  # what lived on (kept, the modules) is frozen
        second = _Cycle()  # a model built after the freeze, then dropped: still freed
        alive = weakref.ref(second)
        del second
        collect_dropped()
        assert alive() is None
    assert gc.get_freeze_count() == 0
    assert gc.isenabled() == was_enabled
    assert kept.me is kept


def test_a_process_that_froze_objects_itself_keeps_them_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_paused():
            dropped = _Cycle()
            alive = weakref.ref(dropped)
            del dropped
            collect_dropped()
            assert alive() is None
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
