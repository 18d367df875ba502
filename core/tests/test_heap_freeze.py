"""``freeze_startup_heap``: what `genartifact serve` / `generate` do once their engine started (issue 13, nineteenth
pass: a full collection of the driver's start-up heap took 0.3-0.56 s and stalled every request)."""

from __future__ import annotations

import gc
import weakref

from genartifact.engine.vllm_adapter import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_collects_garbage_first_then_freezes_what_is_left():
    a, b = Node(), Node()
    a.other, b.other = b, a  # a reference cycle: only the cyclic collector frees it
    dead = weakref.ref(a)
    del a, b
    kept = [Node()]
    try:
        n = freeze_startup_heap()
        assert dead() is None  # the cycle was collected, not frozen for ever
        assert n == gc.get_freeze_count() > 0
        # later collections no longer traverse what was alive at the freeze
        assert not any(o is kept for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())
