"""Retrieval state for graphs that write Hugging Face's own ``StaticCache``.

A ``SpeContextCache`` carries the lagged-query state and the path counters itself. A
``StaticCache`` does not, so the backend owns them: :class:`StaticCacheState` holds, per
model and per shape, the tensors that the adopted graphs (``passes/static_cache.py``) take
as *extra graph inputs*, appended after dynamo's own. The prefill graph records the
retrieval layers' last query rows into them and the next decode graph reads them, so both
graphs of one model must get the same tensors: the state is keyed by the first parameter
the graph reads (a weak key: it goes away with the model) and by (batch, query heads,
head_dim, dtype, device).

Invariants:
- **Never read stale.** Every adopted prefill or decode graph records the query of its
  retrieval layers, stamped with the cache length after its write (``query_valid``); a
  decode step uses the queries only when it starts at that length, else it selects the
  recent window (on the device, no host read). So a prefill Hugging Face ran eagerly (its
  ``CompileConfig`` path), a crop, or a new prompt never reads another step's query
  (except a new prompt whose length happens to equal the previous recorded length).
- **Nothing here changes the KV cache.** The K/V stores are Hugging Face's tensors, written
  by the adopted graph exactly where ``StaticLayer.update`` writes them.
- **Stale only across a row reorder.** ``StaticCache.reorder_cache`` (beam search) cannot
  see this state, so the first step after a reorder selects with the previous row order's
  query (the attention over the selection stays exact; only which tokens are kept differs
  for one step). Use ``SpeContextCache`` for beam search with sparse steps.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from .protocol import STATS
from .retrieval import MAX_RETRIEVAL_LAYERS

__all__ = ["StaticCacheState", "path_counts", "state_for"]

# id(model parameter) -> {shape key -> StaticCacheState}; an entry goes with its parameter
# (weakref.finalize), filled on first compile. Keyed by id: tensors compare elementwise.
_STATES: dict[int, dict[tuple, StaticCacheState]] = {}


@dataclasses.dataclass
class StaticCacheState:
    """The retrieval state of one model at one batch size, owned by the backend.

    Attributes:
        query_state: ``[slots, batch, num_heads, 1, head_dim]`` last query rows of the
            retrieval layers (slot ``i`` = the ``i``-th retrieval layer), the model's dtype.
        query_valid: int64 ``[slots]``, the cache length a slot's query was recorded at
            (0 = never).
        stats: int64 ``[len(STATS)]`` path counters (names: ``protocol.STATS``), advanced by
            every adopted decode step.
    """

    query_state: torch.Tensor
    query_valid: torch.Tensor
    stats: torch.Tensor

    @classmethod
    def allocate(cls, batch: int, num_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> StaticCacheState:
        state = torch.zeros((MAX_RETRIEVAL_LAYERS, batch, num_heads, 1, head_dim), dtype=dtype, device=device)
        valid = torch.zeros((MAX_RETRIEVAL_LAYERS,), dtype=torch.long, device=device)
        stats = torch.zeros((len(STATS),), dtype=torch.long, device=device)
        if device.type == "cuda":  # keep their address for CUDA graphs, like StaticCache's stores
            for t in (state, valid, stats):
                torch._dynamo.mark_static_address(t, guard=False)
        return cls(state, valid, stats)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The extra graph inputs, in the order the adopted graph declares them."""
        return self.query_state, self.query_valid, self.stats


def state_for(owner: torch.Tensor, batch: int, num_heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device) -> StaticCacheState:
    """The state of the model that owns parameter ``owner`` at this shape (allocated on
    first use, zeros)."""
    if id(owner) not in _STATES:
        _STATES[id(owner)] = {}
        weakref.finalize(owner, _STATES.pop, id(owner), None)
    per_shape = _STATES[id(owner)]
    key = (batch, num_heads, head_dim, dtype, str(device))
    if key not in per_shape:
        per_shape[key] = StaticCacheState.allocate(batch, num_heads, head_dim, dtype, device)
    return per_shape[key]


def path_counts(model: torch.nn.Module) -> dict[str, int]:
    """Path counters of every step the backend ran for ``model`` with a Hugging Face
    ``StaticCache`` (summed over batch sizes), e.g. ``{"decode_steps": 20, "sparse_sites":
    600, ...}``; names as :meth:`SpeContextCache.path_counts`. All zeros when no adopted
    graph ran (e.g. the model was never compiled with ``backend="specontext"``)."""
    total = torch.zeros((len(STATS),), dtype=torch.long)
    for param in model.parameters():
        for state in _STATES.get(id(param), {}).values():
            total += state.stats.cpu()
    return dict(zip(STATS, total.tolist()))
