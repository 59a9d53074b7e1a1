"""Per-cache retrieval state for Hugging Face's ``StaticCache``, and per-model path counters.

A ``SpeContextCache`` carries the lagged-query state and the path counters itself. A
``StaticCache`` does not, so the backend keeps them beside it: :class:`StaticCacheState`
holds the tensors that the adopted graphs (``passes/static_cache.py``) take as *extra graph
inputs*, appended after dynamo's own. The prefill graph records the retrieval layers' last
query rows into them and the next decode graph of the *same cache* reads them.

Keys:
- **Retrieval state: per cache** (issue 25: two conversations on one model, each with its
  own ``StaticCache``, must not read each other's lagged query). The key is the cache's
  first adopted key store ``[batch, num_kv_heads, max_cache_len, head_dim]`` (a weak key:
  the state goes with the store), plus (batch, query heads, head_dim, dtype, device). A
  graph that *creates* the stores (Hugging Face initialises a ``StaticCache`` lazily, inside
  the first compiled call) runs with a fresh state, bound to the store it returns.
- **Path counters: per cache and per model.** Every rewritten graph, whatever its cache,
  also adds what it counted to the counters of the model whose parameters it reads
  (:func:`model_stats`), so :func:`path_counts` answers for the model in every way the
  README gives (``sc.compile`` + ``generate``, ``torch.compile`` with either cache, Hugging
  Face's ``compile_config``).

Invariants:
- **Never read stale.** Every adopted prefill or decode graph records the query of its
  retrieval layers, stamped with the cache length after its write (``query_valid``); a
  decode step uses the queries only when it starts at that length, else it selects the
  recent window (on the device, no host read). So a prefill Hugging Face ran eagerly (its
  ``CompileConfig`` path) or a new prompt never reads another step's query; after
  ``StaticCache.crop`` the step restores the kept token's own query from the rollback
  history (``runtime/rollback.py``: matched by the store's key row, so never a dropped
  branch's or an earlier prompt's).
- **Any batch size.** A graph dynamo made batch-symbolic serves every batch; the state is
  allocated per cache at the call's real batch (``passes/static_cache.BatchReader``).
- **Never another cache's.** A state is found from the store tensors the call passes, so
  two caches never share one (nor two models: their stores differ).
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
from .rollback import QUERY_SLOTS
from .torch_private import mark_static_address

__all__ = ["StaticCacheState", "bind_state", "model_stats", "path_counts", "state_for"]

# id(key store) -> {shape key -> StaticCacheState}; an entry goes with its store
# (weakref.finalize). Keyed by id: tensors compare elementwise.
_STATES: dict[int, dict[tuple, StaticCacheState]] = {}
# id(model parameter) -> {device -> int64 [len(STATS)]}: what every graph of the model counted
_MODEL_STATS: dict[int, dict[str, torch.Tensor]] = {}


@dataclasses.dataclass
class StaticCacheState:
    """The retrieval state of one ``StaticCache`` at one batch size, owned by the backend.

    Attributes:
        query_state: ``[QUERY_SLOTS, batch, num_heads, 1, head_dim]`` last query rows of the
            retrieval layers (slot ``i`` = the ``i``-th retrieval layer), the model's dtype,
            then the rollback history (``runtime/rollback.py``).
        query_valid: int64 ``[slots]``, the cache length a slot's query was recorded at
            (0 = never).
        stats: int64 ``[len(STATS)]`` path counters of this cache (names:
            ``protocol.STATS``), advanced by every adopted decode step.
    """

    query_state: torch.Tensor
    query_valid: torch.Tensor
    stats: torch.Tensor

    @classmethod
    def allocate(cls, batch: int, num_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> StaticCacheState:
        # the current slots, then the rollback history (runtime/rollback.py)
        state = torch.zeros((QUERY_SLOTS, batch, num_heads, 1, head_dim), dtype=dtype, device=device)
        valid = torch.zeros((QUERY_SLOTS,), dtype=torch.long, device=device)
        stats = torch.zeros((len(STATS),), dtype=torch.long, device=device)
        _static_address(state, valid, stats)
        return cls(state, valid, stats)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The extra graph inputs, in the order the adopted graph declares them."""
        return self.query_state, self.query_valid, self.stats


def _static_address(*tensors: torch.Tensor) -> None:
    if tensors and tensors[0].device.type == "cuda":  # keep their address for CUDA graphs, like the stores
        for t in tensors:
            mark_static_address(t)


def _shape_key(batch: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple:
    return (batch, num_heads, head_dim, dtype, str(device))


def _entries(table: dict, tensor: torch.Tensor) -> dict:
    """``table``'s dict for ``tensor`` (created empty on first use; it goes with the tensor)."""
    entries = table.get(id(tensor))
    if entries is None:
        entries = table[id(tensor)] = {}
        weakref.finalize(tensor, table.pop, id(tensor), None)
    return entries


def state_for(store: torch.Tensor, batch: int, num_heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device) -> StaticCacheState:
    """The state of the cache whose first adopted key store is ``store``, at this shape
    (allocated on first use, zeros)."""
    per_shape = _entries(_STATES, store)
    key = _shape_key(batch, num_heads, head_dim, dtype, device)
    if key not in per_shape:
        per_shape[key] = StaticCacheState.allocate(batch, num_heads, head_dim, dtype, device)
    return per_shape[key]


def bind_state(store: torch.Tensor, state: StaticCacheState, batch: int, num_heads: int, head_dim: int,
               dtype: torch.dtype, device: torch.device) -> None:
    """Make ``state`` (used by a graph that created ``store``) the state of ``store``'s cache."""
    _entries(_STATES, store)[_shape_key(batch, num_heads, head_dim, dtype, device)] = state


def model_stats(owner: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The int64 ``[len(STATS)]`` counters of the model that owns parameter ``owner`` on
    ``device`` (zeros on first use); every rewritten graph of that model adds to them."""
    per_device = _entries(_MODEL_STATS, owner)
    key = str(device)
    if key not in per_device:
        per_device[key] = torch.zeros((len(STATS),), dtype=torch.long, device=device)
        _static_address(per_device[key])
    return per_device[key]


def path_counts(obj) -> dict[str, int]:
    """Path counters of the decode steps the backend ran, e.g. ``{"decode_steps": 20,
    "sparse_sites": 600, "gather_sites": 600, ...}`` (names: ``protocol.STATS``, as
    :meth:`SpeContextCache.path_counts`).

    Args:
        obj: a model compiled with ``backend="specontext"`` (every step of every cache it
            ran with, in every way: ``specontext_compile.compile`` + ``generate``,
            ``torch.compile`` with a ``SpeContextCache`` or Hugging Face's ``StaticCache``,
            ``generate(compile_config=...)``); a ``SpeContextCache``; or a Hugging Face
            ``StaticCache`` (the steps run with that cache).

    Returns all zeros when no rewritten graph ran for ``obj`` (e.g. never compiled with the
    backend, or every step fell back to dense: see the backend's warnings).

    Raises:
        TypeError: ``obj`` is none of these.
    """
    total = torch.zeros((len(STATS),), dtype=torch.long)
    if isinstance(obj, torch.nn.Module):
        for param in obj.parameters():
            for stats in _MODEL_STATS.get(id(param), {}).values():
                total += stats.cpu()
        return dict(zip(STATS, total.tolist()))
    own = getattr(obj, "path_counts", None)
    if callable(own):  # SpeContextCache
        return own()
    layers = getattr(obj, "layers", None)
    if layers is None:
        raise TypeError(f"specontext: path_counts takes a model, a SpeContextCache or a Hugging Face cache, "
                        f"not {type(obj).__name__}")
    for layer in layers:
        keys = getattr(layer, "keys", None)
        for state in _STATES.get(id(keys), {}).values() if keys is not None else ():
            total += state.stats.cpu()
    return dict(zip(STATS, total.tolist()))
