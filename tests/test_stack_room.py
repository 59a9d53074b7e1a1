"""The compiled step's Python runs in a fresh data-stack chunk (``specontext_compile/stack_room.py``, issue 51).

CPython 3.11+ maps a chunk for a frame that does not fit the current one and unmaps it when
that frame returns: a frame at a chunk's end maps and unmaps memory on every call it makes,
and each fresh mapping costs a page fault when the callee's frame is written. The mechanism
test counts those faults (``ru_minflt``) for a burst of calls at every depth of a stack scan:
outside the room some depth sits at a boundary (a fault per call), inside the room none does.
"""

from __future__ import annotations

import resource
import sys

import pytest
import torch
from _tiny import tiny_llama
from test_backend_e2e import decode_logits
from torch._dynamo.utils import counters

import specontext_compile as sc
from specontext_compile import stack_room

CALLS = 200  # calls per depth: a boundary shows as about one fault each


def _empty():
    """A frame of about 50 slots (400 bytes: wider than a scan step of ~110 bytes, so the scan
    cannot step over the depths where it no longer fits a chunk), that does nothing."""
    if False:
        _a0 = _a1 = _a2 = _a3 = _a4 = _a5 = _a6 = _a7 = _a8 = _a9 = None
        _b0 = _b1 = _b2 = _b3 = _b4 = _b5 = _b6 = _b7 = _b8 = _b9 = None
        _c0 = _c1 = _c2 = _c3 = _c4 = _c5 = _c6 = _c7 = _c8 = _c9 = None
        _d0 = _d1 = _d2 = _d3 = _d4 = _d5 = _d6 = _d7 = _d8 = _d9 = None
        _e0 = _e1 = _e2 = _e3 = _e4 = _e5 = _e6 = _e7 = _e8 = _e9 = None


def _burst():
    """Minor page faults of CALLS calls of an empty function made from this frame."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(CALLS):
        _empty()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _at_depth(depth: int, out: list) -> None:
    """Recurse ``depth`` frames (about 100 bytes each), then record a burst's faults at every level on the way back."""
    if depth:
        _at_depth(depth - 1, out)
    out.append(_burst())


def _scan(depth: int) -> list[int]:
    out: list[int] = []
    _at_depth(depth, out)
    return out


def test_the_room_passes_arguments_results_and_errors_through():
    def add(a, b):
        return a + b

    def fail(message):
        raise KeyError(message)

    assert stack_room.with_stack_room(add)(2, 3) == 5
    with pytest.raises(KeyError, match="the caller's"):
        stack_room.with_stack_room(fail)("the caller's")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="frames live on chunked data stacks from CPython 3.11")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts page faults with getrusage (Linux)")
def test_calls_inside_the_room_map_no_chunk_where_a_boundary_outside_maps_one_per_call():
    """A scan of 640 frames (over 64 KiB) outside the room crosses a chunk boundary: the depth
    there faults about once per call. The same scan 180 frames deep (about 18 KiB, under the
    room's ~29 KiB) inside the room faults at no depth."""
    outside = _scan(640)
    assert max(outside) >= CALLS * 0.9, f"no chunk boundary found by the scan (faults per depth: max {max(outside)})"
    inside = stack_room.with_stack_room(_scan)(180)
    assert max(inside) < CALLS * 0.1, f"a boundary inside the room: {max(inside)} faults for {CALLS} calls"


def test_the_compiled_step_is_called_through_the_room():
    """Both ways the backend returns a graph go through the room: inductor's compiled step and
    ``inner="eager"``'s graph module (the counter: one per graph call)."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    for options in ({"budget": 8}, {"budget": 8, "inner": "eager"}):
        torch._dynamo.reset()
        before = counters["specontext"]["stack_room_calls"]
        compiled = torch.compile(model.forward, backend="specontext", options=options)
        decode_logits(model, compiled, ids, 2, sc.SpeContextCache(model.config, max_cache_len=40))
        assert counters["specontext"]["stack_room_calls"] - before >= 3, options  # prefill and two steps
