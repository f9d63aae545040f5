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
    # Observed through behaviour, not gc.get_freeze_count(): that count also drops whenever any frozen
    # object is freed by refcount (another thread, a finalizer), so an equality on it is flaky.
    was_frozen = _Cycle()
    frozen_alive = weakref.ref(was_frozen)
    gc.freeze()
    del was_frozen  # an unreachable cycle the process froze: only an unfreeze lets a collection free it
    try:
        with gc_paused():
            dropped = _Cycle()
            alive = weakref.ref(dropped)
            del dropped
            collect_dropped()
            assert alive() is None
            assert frozen_alive() is not None
        gc.collect()
        assert frozen_alive() is not None  # gc_paused did not unfreeze the process's objects
    finally:
        gc.unfreeze()
    gc.collect()
    assert frozen_alive() is None
