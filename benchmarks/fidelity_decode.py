"""Selection policies inside the model's attention: greedy agreement and NLL (issue 6, part 3).

The recall harness (:mod:`benchmarks.fidelity`) scores selections against attention recorded
from a *dense* run. Here every policy of ``benchmarks/policies.py`` runs inside the model: one
dense prefill of ``context`` tokens (shared by every run), then ``decode_tokens``
teacher-forced decode steps in which each layer's attention sees only the tokens the policy
selected (``budget`` per KV head, sinks and a recent window inside the budget, as in the recall
harness; a KV head's selection is shared by the query heads of its GQA group). Per policy and
budget we report, against a dense run over the same inputs:

* **agreement**: share of decode steps whose argmax token equals the dense run's;
* **NLL delta**: mean NLL (nats/token) of the true next token minus the dense run's;
* **recall (in-run)**: share of each layer/head's *full* attention (the policy run's own query
  over every cached key) inside the selection, averaged over layers, heads and steps.

Faithfulness of the runs:

* ``shared`` policies (ours, StreamingLLM, random) select once per step, when layer 0's
  attention is called, from what exists then: the lagged query uses the *policy run's* own
  queries of the previous step (for step 0: the prefill's last query row) against the key
  caches as they are before this step's write (layer 0's already holds this step's key; the
  policy only reads the ``n`` cached tokens). The selection is used by every layer.
* per-layer policies (Quest, H2O, the oracle) select inside each layer from that layer's
  current query and keys of the policy run.
* H2O's accumulated attention starts from the dense prefill (its last ``h2o_queries`` query
  rows) and then adds, after each layer's step, the attention the *policy run* paid (its
  masked softmax, max over the GQA group), not the dense run's.

Budgets are run as one batch per policy (one batch row per budget); the dense baseline is one
run per context whose argmax tokens and NLLs are shared by every policy.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Sequence

import torch
from benchmarks import policies as P
from benchmarks.host_selection import select_tokens
from tqdm.auto import tqdm
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

logger = logging.getLogger(__name__)

ATTN_NAME = "specontext_fidelity_decode"

__all__ = ["DecodeResult", "masked_attention", "prefill", "run_policy", "selection_mask", "sweep"]


def selection_mask(selection: torch.Tensor, n: int) -> torch.Tensor:
    """Bool ``[num_kv_heads, n]`` mask of the positions in ``selection``.

    Args:
        selection: int64 ``[num_kv_heads, slots]`` positions ``< n``; ``-1`` entries are padding.
        n: keys in the cache (this step's included).
    """
    mask = torch.zeros(selection.shape[0], n + 1, dtype=torch.bool, device=selection.device)
    mask.scatter_(1, torch.where(selection >= 0, selection, n), True)
    return mask[:, :n]


def masked_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode row's attention over the selected keys only (float32 arithmetic).

    Args:
        query: ``[batch, num_heads, 1, head_dim]``.
        key, value: ``[batch, num_kv_heads, n, head_dim]``.
        mask: bool ``[batch, num_kv_heads, n]`` (True = attend), shared by the query heads of
            each GQA group; ``None`` attends to every key (dense).
        scale: softmax scale.

    Returns:
        ``(output, probs, full)``: ``output`` ``[batch, 1, num_heads, head_dim]`` in the
        query's dtype (HF attention layout), ``probs`` float32 ``[batch, num_heads, n]`` the
        masked softmax actually used, ``full`` float32 ``[batch, num_heads, n]`` the dense
        softmax of the same logits (for recall).
    """
    b, h, _, d = query.shape
    kv, n = key.shape[1], key.shape[2]
    g = h // kv
    q = query.float().view(b, kv, g, d)
    logits = torch.matmul(q, key.float().transpose(-1, -2)) * scale  # [b, kv, g, n]
    full = torch.softmax(logits, -1)
    probs = full if mask is None else torch.softmax(logits.masked_fill(~mask[:, :, None], float("-inf")), -1)
    out = torch.matmul(probs, value.float())  # [b, kv, g, d]
    return out.view(b, 1, h, d).to(query.dtype), probs.view(b, h, n), full.view(b, h, n)


@dataclasses.dataclass
class Prefill:
    """The shared dense prefill of one context.

    Attributes:
        cache: batch-1 cache of the ``context`` prompt tokens (copied for every run).
        last_queries: per layer ``[1, num_heads, 1, head_dim]``: the last prompt row's query
            (the lagged query of decode step 0).
        accumulated: per layer float32 ``[num_kv_heads, context]``: H2O's accumulated
            attention over the last ``h2o_queries`` prompt rows (max over the group).
    """

    cache: DynamicCache
    last_queries: dict[int, torch.Tensor]
    accumulated: dict[int, torch.Tensor]
    aux: torch.Tensor | None = None  # [1, context, len(aux_layers) * hidden], each token's own


def prefill(model, ids: torch.Tensor, context: int, h2o_queries: int = 256,
            aux_layers: Sequence[int] = ()) -> Prefill:
    """Dense prefill of ``ids[:, :context]`` (``[1, tokens]`` int64), recording what the
    policies need (see :class:`Prefill`); with ``aux_layers``, also the hidden states after
    those decoder layers for every prompt token (draft heads' fused input)."""
    from benchmarks.fidelity import prompt_accumulation

    prompt_q: dict[int, torch.Tensor] = {}
    keys: dict[int, torch.Tensor] = {}

    def recording(module, q, k, v, mask, **kw):
        prompt_q[module.layer_idx] = q[:, :, -h2o_queries:].detach()
        keys[module.layer_idx] = k.detach()
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register(ATTN_NAME, recording)
    model.set_attn_implementation(ATTN_NAME)
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            out = model(ids[:, :context], cache=cache, use_cache=True,
                        output_hidden_states=bool(aux_layers))
    finally:
        model.set_attn_implementation("sdpa")
    aux = _aux_states(out, aux_layers) if aux_layers else None
    scale = model.model.layers[0].self_attn.scaling
    acc = {l: a.float() for l, a in prompt_accumulation(prompt_q, keys, context, scale).items()}
    return Prefill(cache, {l: q[:, :, -1:].clone() for l, q in prompt_q.items()}, acc, aux)


def _aux_states(out, aux_layers: Sequence[int]) -> torch.Tensor:
    """``[batch, tokens, len(aux_layers) * hidden]``: hidden states after decoder layers
    ``aux_layers`` (HF ``hidden_states[j + 1]``), the convention of runtime/distill.py."""
    return torch.cat([out.hidden_states[j + 1] for j in aux_layers], -1).detach()


class _DraftKeys:
    """A draft head's own key cache per batch row (SpeContext section 4): prompt keys from
    the dense prefill, then one key per decode step from the policy run's own previous-token
    hidden states (EAGLE-3 feeds the previous token's states; zeros for the first token and
    for embedding-only heads)."""

    def __init__(self, policy: P.DraftHead, pre: Prefill, ids: torch.Tensor, context: int, rows: int):
        self.policy = policy
        aux = pre.aux if policy.fused else torch.zeros_like(pre.aux)
        shifted = torch.cat([torch.zeros_like(aux[:, :1]), aux[:, :-1]], 1)
        with torch.no_grad():
            _, k = policy.head(ids[:, :context], shifted, torch.arange(context)[None])
        self.keys = [k.clone() for _ in range(rows)]  # each [1, head_kv, tokens, head_dim]
        self.prev_aux = aux[:, -1:].expand(rows, -1, -1).clone()  # last prompt token's states

    def scores(self, row: int, token: torch.Tensor, position: int) -> torch.Tensor:
        """``[head_kv_heads, position]``: softmax of this step's head query over the head
        keys of the cached tokens; appends this step's key (used from the next step on)."""
        aux = self.prev_aux[row : row + 1] if self.policy.fused else torch.zeros_like(self.prev_aux[:1])
        with torch.no_grad():
            q, k = self.policy.head(token, aux, torch.tensor([[position]]))
        keys = self.keys[row]
        logits = (q[0, :, -1:].float() @ keys[0].float().transpose(-1, -2))[:, 0] * q.shape[-1] ** -0.5
        self.keys[row] = torch.cat([keys, k], 2)
        return torch.softmax(logits.float(), -1)

    def record(self, out) -> None:
        """Keep this step's hidden states (every row) for the next step's head input."""
        self.prev_aux = _aux_states(out, self.policy.head.aux_layer_ids)[:, -1:]


class _PreallocatedLayer(DynamicLayer):
    """A cache layer that writes decode keys/values in place into a buffer sized for the
    whole run (HF's ``DynamicLayer`` re-concatenates the cache every step, which dominates a
    CPU decode step at 8K tokens). ``keys``/``values`` are views of the filled part."""

    def update(self, key_states, value_states, *args, **kwargs):
        n, q = self.keys.shape[-2], key_states.shape[-2]
        self._kbuf[:, :, n : n + q] = key_states
        self._vbuf[:, :, n : n + q] = value_states
        self.keys, self.values = self._kbuf[:, :, : n + q], self._vbuf[:, :, : n + q]
        return self.keys, self.values


def _run_cache(pre: DynamicCache, rows: int, capacity: int) -> DynamicCache:
    """A copy of the prefill cache ``pre`` repeated over ``rows`` batch rows, with room for
    ``capacity`` tokens per layer (see :class:`_PreallocatedLayer`)."""
    cache = copy.deepcopy(pre)
    for layer in cache.layers:
        b, h, n, d = layer.keys.shape
        for name in ("keys", "values"):
            buf = torch.empty(rows, h, capacity, d, dtype=layer.keys.dtype)
            buf[:, :, :n] = getattr(layer, name)
            setattr(layer, "_kbuf" if name == "keys" else "_vbuf", buf)
        layer.keys, layer.values = layer._kbuf[:, :, :n], layer._vbuf[:, :, :n]
        layer.__class__ = _PreallocatedLayer
    return cache


@dataclasses.dataclass
class DecodeResult:
    """Per batch row (budget) results of one teacher-forced run over ``steps`` tokens.

    Attributes:
        argmax: int64 ``[rows, steps]`` greedy token of each step.
        nll: float64 ``[rows, steps]`` NLL (nats) of the true next token.
        recall: float64 ``[rows]`` mean in-run recall (1.0 for dense rows).
    """

    argmax: torch.Tensor
    nll: torch.Tensor
    recall: torch.Tensor


class _Run:
    """The attention function and per-row state of one batched policy run."""

    def __init__(self, policy, budgets: Sequence[int | None], pre: Prefill, cache: DynamicCache,
                 capacity: int, sink: int, window: int, scale: float):
        self.policy, self.budgets, self.cache = policy, list(budgets), cache
        self.sink, self.window, self.scale = sink, window, scale
        rows = len(self.budgets)
        self.prev = {l: q.expand(rows, -1, -1, -1).clone() for l, q in pre.last_queries.items()}
        self.current: dict[int, torch.Tensor] = {}
        self.acc = {}
        if isinstance(policy, P.H2O):
            for l, a in pre.accumulated.items():
                full = torch.zeros(rows, a.shape[0], capacity)
                full[:, :, : a.shape[1]] = a
                self.acc[l] = full
        self.shared_mask: torch.Tensor | None = None
        self.draft: _DraftKeys | None = None  # set by run_policy for draft heads
        self.token: torch.Tensor | None = None  # [1, 1] this step's input token
        self.position = 0
        self.recall_sum = torch.zeros(rows, dtype=torch.float64)
        self.recall_terms = 0

    def _masks(self, layer: int, q: torch.Tensor, n_after: int) -> torch.Tensor | None:
        """Bool ``[rows, num_kv_heads, n_after]`` selection masks (None: all rows dense)."""
        if all(b is None for b in self.budgets):
            return None
        layers = len(self.cache.layers)
        masks = []
        for r, budget in enumerate(self.budgets):
            kv = self.cache.layers[0].keys.shape[1]
            if budget is None or budget >= n_after:
                masks.append(torch.ones(kv, n_after, dtype=torch.bool))
                continue
            if self.draft is not None:
                scores = self.draft.scores(r, self.token, self.position)
                sel = select_tokens(scores[None], n_after, 1, budget, self.sink, self.window)[0]
                masks.append(selection_mask(sel, n_after))
                continue
            step = P.DecodeStep(
                queries=[q[r : r + 1] if j == layer else None for j in range(layers)],
                keys=[self.cache.layers[j].keys[r : r + 1] for j in range(layers)],
                previous_queries=[self.prev[j][r : r + 1] for j in range(layers)],
                accumulated=[self.acc[j][r] for j in range(layers)] if self.acc else None,
                scale=self.scale,
            )
            scores = self.policy.scores(step, layer)
            sel = select_tokens(scores.float()[None], n_after, 1, budget, self.sink, self.window)[0]
            masks.append(selection_mask(sel, n_after))
        return torch.stack(masks)

    def attention(self, module, query, key, value, attention_mask, **kw):
        """HF ``AttentionInterface`` function: dense for prefill rows (q_len > 1), the
        policy's selection for decode rows. The causal mask is ignored at decode (one new
        row, every cached key visible, no padding)."""
        if query.shape[2] != 1:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
        layer, n_after = module.layer_idx, key.shape[2]
        scale = kw.get("scaling") or module.scaling
        if self.policy is None:
            mask = None
        elif getattr(self.policy, "shared", False):
            if layer == 0:
                self.shared_mask = self._masks(0, query, n_after)
            mask = None if self.shared_mask is None else self.shared_mask[..., :n_after]
        else:
            mask = self._masks(layer, query, n_after)
        out, probs, full = masked_attention(query, key, value, mask, scale)
        self.current[layer] = query.detach()
        rows, heads = query.shape[0], query.shape[1]
        kv = key.shape[1]
        if mask is not None:
            inside = (full * mask.repeat_interleave(heads // kv, 1)).sum(-1).mean(-1)
            self.recall_sum += inside.double()
        else:
            self.recall_sum += 1.0
        self.recall_terms += 1
        if self.acc:  # H2O: add what this run attended (after selecting)
            self.acc[layer][:, :, :n_after] += probs.view(rows, kv, heads // kv, n_after).amax(2)
        return out, None

    def end_step(self) -> None:
        """The queries of the step just run become the next step's lagged queries."""
        self.prev = dict(self.current)
        self.current = {}


def run_policy(model, ids: torch.Tensor, pre: Prefill, context: int, steps: int, policy,
               budgets: Sequence[int | None], sink: int = 4, window: int = 64,
               desc: str | None = None) -> DecodeResult:
    """Teacher-forced decode of ``ids[:, context : context + steps]`` after ``pre``, one
    batch row per budget (``None``: dense), the policy (``None``: dense) inside attention.

    Args:
        ids: int64 ``[1, tokens]`` with ``tokens > context + steps`` (the true next tokens).
        budgets: tokens per KV head of each row.
    """
    if ids.shape[1] <= context + steps:
        raise ValueError(f"need {context + steps + 1} tokens of text, have {ids.shape[1]}")
    rows = len(budgets)
    cache = _run_cache(pre.cache, rows, context + steps)
    scale = model.model.layers[0].self_attn.scaling
    run = _Run(policy, budgets, pre, cache, context + steps, sink, window, scale)
    if isinstance(policy, P.DraftHead):
        if pre.aux is None:
            raise ValueError("draft heads need a prefill with aux_layers (the head's aux_layer_ids)")
        run.draft = _DraftKeys(policy, pre, ids, context, rows)
    AttentionInterface.register(ATTN_NAME, run.attention)
    model.set_attn_implementation(ATTN_NAME)
    argmax = torch.zeros(rows, steps, dtype=torch.long)
    nll = torch.zeros(rows, steps, dtype=torch.float64)
    try:
        with torch.no_grad():
            for i in tqdm(range(steps), desc=desc, leave=False, disable=desc is None):
                run.token, run.position = ids[:, context + i : context + i + 1], context + i
                tok = run.token.expand(rows, 1)
                out = model(tok, cache=cache, use_cache=True, output_hidden_states=run.draft is not None)
                if run.draft is not None:
                    run.draft.record(out)
                logits = out.logits[:, -1].float()
                argmax[:, i] = logits.argmax(-1)
                nll[:, i] = -torch.log_softmax(logits.double(), -1)[:, int(ids[0, context + i + 1])]
                run.end_step()
    finally:
        model.set_attn_implementation("sdpa")
    return DecodeResult(argmax, nll, run.recall_sum / max(run.recall_terms, 1))


def sweep(model, ids: torch.Tensor, context: int, steps: int, budgets: Sequence[int], policies: dict,
          sink: int = 4, window: int = 64, h2o_queries: int = 256, done: dict | None = None,
          on_policy=None) -> dict:
    """Every policy x budget at one context against one dense run.

    Args:
        done: results of an earlier sweep of the same settings (this function's return
            value): its policies are kept and not run again.
        on_policy: called with the partial result after every policy (e.g. to save it).

    Returns:
        ``{"dense_nll": float, "policies": {name: {budget: {"recall", "agreement",
        "nll_delta", "nll"}}}}``; NLLs in nats/token, means over the ``steps`` decode steps.
    """
    aux_layers = next((tuple(p.head.aux_layer_ids) for p in policies.values()
                       if isinstance(p, P.DraftHead)), ())
    pre = prefill(model, ids, context, h2o_queries, aux_layers)
    dense = run_policy(model, ids, pre, context, steps, None, [None], sink, window,
                       desc=f"context {context}: dense")
    dense_nll = float(dense.nll.mean())
    out = {"dense_nll": dense_nll, "steps": steps, "policies": {}}
    if done and done.get("steps") == steps:
        if abs(done["dense_nll"] - dense_nll) > 1e-6:
            raise ValueError("the earlier sweep had another dense run; not resuming")
        out["policies"].update({k: v for k, v in done["policies"].items() if k in policies})
    for name, policy in policies.items():
        if name in out["policies"]:
            logger.info("context %d %s: kept from the earlier sweep", context, name)
            continue
        res = run_policy(model, ids, pre, context, steps, policy, list(budgets), sink, window,
                         desc=f"context {context}: {name}")
        out["policies"][name] = {
            b: {
                "recall": float(res.recall[r]),
                "agreement": float((res.argmax[r] == dense.argmax[0]).double().mean()),
                "nll_delta": float(res.nll[r].mean()) - dense_nll,
                "nll": float(res.nll[r].mean()),
            }
            for r, b in enumerate(budgets)
        }
        logger.info("context %d %s: %s", context, name, out["policies"][name])
        if on_policy is not None:
            on_policy(out)
    return out
