"""Room on CPython's frame stack for a compiled step's Python, so its calls stop mapping memory (issue 51).

CPython 3.11 and later keep each thread's Python frames on a *data stack* made of chunks of
16 KiB or more (``Python/pystate.c``: ``push_chunk``): a call whose frame does not fit in the
current chunk maps a new chunk (``mmap``), and the return that pops that chunk's first frame
unmaps it (``munmap``) at once. A frame sitting at a chunk's end therefore maps and unmaps
memory on *every* call it makes. A compiled decode step makes several hundred Python calls
(inductor's wrapper code, each region's function, our ops' Python bodies and checks), and
where the caller's stack happens to put them at a boundary each call costs an ``mmap`` and a
``munmap``; with a second core busy in an OpenMP barrier the ``munmap``'s TLB shootdown (an
interrupt to that core, a VM exit on a virtual machine) made an empty Python call cost about
21 µs instead of 0.03 (SmolLM2-135M at 8K on a 2-core Xeon: the step's stack was 15.7 KiB
deep at our refine op's checks; docs/benchmarks.md, "How the step got here").

:func:`with_stack_room` calls the compiled step through one frame large enough
(:data:`ROOM_WORDS` local slots) that it never fits the current chunk: CPython maps a fresh
chunk for it, sized with its fixed overhead of 1000 slots to the next power of two times
16 KiB (64 KiB), and every frame of the step below it lands in that chunk's remaining ~29 KiB
instead of crossing a boundary. Cost: one chunk mapped and unmapped per step (a few µs), and
the frame's slots cleared on entry (34 KiB).

Invariants: the wrapped function's arguments, result and exceptions pass through unchanged;
nothing global changes (the caller is a plain function made once, on first use); on
CPython before 3.11 (frames on the heap, no chunks) :func:`with_stack_room` returns the
function itself.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from .runtime.torch_private import counters

__all__ = ["ROOM_WORDS", "with_stack_room"]

#: local slots of the room frame: 4300 x 8 bytes (34.4 KiB) plus CPython's 1000-slot overhead
#: is over 32 KiB, so the chunk mapped for it is 64 KiB, with ~29 KiB left for the step's own
#: frames (15.7 KiB deep at our ops' checks, from the frame of the backend's callable down)
ROOM_WORDS = 4300


@functools.cache
def _room_caller() -> Callable[..., Any]:
    """``call(fn, args)`` = ``fn(*args)`` through a frame of :data:`ROOM_WORDS` slots. The
    slots are locals that only unreachable code assigns: the compiler keeps them in the code
    object (``co_nlocals``), the frame reserves them, no bytecode touches them."""
    names = " = ".join(f"_slot{i}" for i in range(ROOM_WORDS))
    source = (f"def call(fn, args):\n"
              f"    if False:\n"
              f"        {names} = None\n"
              f"    return fn(*args)\n")
    namespace: dict[str, Any] = {}
    exec(compile(source, "<specontext stack room>", "exec"), namespace)  # noqa: S102 - our own fixed source
    return namespace["call"]


def with_stack_room(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` called through a frame that starts a fresh data-stack chunk (module docstring),
    positional arguments only (dynamo calls a backend's result that way). Each call counts
    ``counters["specontext"]["stack_room_calls"]``. Returns ``fn`` itself before CPython 3.11."""
    if sys.version_info < (3, 11):
        return fn
    room = _room_caller()

    def call(*args):
        counters["specontext"]["stack_room_calls"] += 1
        return room(fn, args)

    return call
