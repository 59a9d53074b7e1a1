"""Sparse (small-budget) decode on left-padded batches, checked at the sparse op (issue 12).

A budget smaller than the context cannot be compared with eager dense decoding, so each
call of the sparse attention op is compared instead with attention computed by hand, in
float64, over exactly the positions the op was given: per batch row, query head and query
row, the selected positions of its KV head that are not ``-1`` padding, lie within the
causal limit (``p <= length - q_len + r``) and are visible in the Hugging Face mask; a
softmax of ``q . k * scale`` (plus an additive mask, if any) over those, times their
values. The step runs eagerly (``inner="eager"``: the lowered step, each site's refinement and
attention two calls) so that the attention's body (``aten_step.sparse_attention``, which
the lowering binds when the graph is compiled) can be wrapped and sees every call.

The batches are left-padded (one row unpadded, one lightly padded, one with fewer real
tokens than the budget, so its selection holds ``-1`` padding): no selected position may
be a pad position of its row (padding-aware selection: the selection node gets the site's
attention mask).
"""

import pytest
import torch
from specontext_compile.runtime import aten_step

import specontext_compile as sc
from specontext_compile.tiny_models import VOCAB, tiny_family

PROMPT = 40
PADS = (0, 7, 36)  # left padding per row: row 2 has 4 real prompt tokens (< BUDGET)
NEW_TOKENS = 6  # generate: 1 token from the prefill + 5 decode steps
BUDGET, SINK, WINDOW = 8, 2, 3
LAYERS = 2  # tiny_family models have 2 decoder layers

# float32 op (gather + float32 matmul/softmax) vs the float64 reference: head_dim 16,
# <= 46 positions; observed max |diff| ~4e-8 (sdpa and eager masks), bound 1e-5
ATOL, RTOL = 1e-5, 1e-5


def _mask_at(attn_mask, i, head, r, p):
    """(visible, additive term) of a HF mask ``[batch|1, 1|heads, q_len, >= capacity]`` at
    batch row ``i``, query head ``head``, query row ``r``, position ``p``; positions past
    the mask's width are hidden (as the op's ``row_visibility`` does)."""
    if attn_mask is None:
        return True, 0.0
    if p >= attn_mask.shape[-1]:
        return False, 0.0
    m = attn_mask[i if attn_mask.shape[0] > 1 else 0, head if attn_mask.shape[1] > 1 else 0, r, p]
    if m.dtype == torch.bool:
        return bool(m), 0.0
    value = float(m)  # HF's additive masks hide with the dtype's min (or -inf)
    visible = value > torch.finfo(m.dtype).min / 2
    return visible, value if visible else 0.0


def reference_attention(query, key_cache, value_cache, indices, length, attn_mask, scale):
    """Float64 attention of every query row over its selected, allowed positions (module
    docstring); a row that may see nothing is zero (the op's documented convention)."""
    b, num_heads, q_len, _ = query.shape
    groups = num_heads // key_cache.shape[1]
    out = torch.zeros(b, num_heads, q_len, value_cache.shape[-1], dtype=torch.float64)
    for i in range(b):
        total = int(length[i] if length.dim() else length)
        for head in range(num_heads):
            kv = head // groups
            selected = [p for p in indices[i, kv].tolist() if p >= 0]
            for r in range(q_len):
                keep, add = [], []
                for p in selected:
                    visible, term = _mask_at(attn_mask, i, head, r, p)
                    if p <= total - q_len + r and visible:
                        keep.append(p)
                        add.append(term)
                if not keep:
                    continue
                k = key_cache[i, kv, keep].double()
                v = value_cache[i, kv, keep].double()
                logits = (query[i, head, r].double() @ k.T) * scale + torch.tensor(add, dtype=torch.float64)
                out[i, head, r] = torch.softmax(logits, -1) @ v
    return out


def capture_sparse_calls(monkeypatch):
    """Wrap ``aten_step.sparse_attention``: record (query, key store, value store, indices,
    length, attn_mask, scale, soft_cap, sliding_window, dense_shortcut, output) per call."""
    seen = []
    real = aten_step.sparse_attention

    def spy(query, key_cache, value_cache, indices, length, attn_mask, spec, variant):
        out = real(query, key_cache, value_cache, indices, length, attn_mask, spec, variant)
        mask = attn_mask.clone() if attn_mask is not None else None
        seen.append({"query": query.clone(), "key_cache": key_cache.clone(), "value_cache": value_cache.clone(),
                     "indices": indices.clone(), "length": length.clone(), "attn_mask": mask,
                     "scale": variant.scale, "soft_cap": variant.soft_cap, "sliding_window": variant.sliding_window,
                     "dense_shortcut": spec.dense_shortcut, "out": out.clone()})
        return out

    monkeypatch.setattr(aten_step, "sparse_attention", spy)
    return seen


def left_padded_batch(seed=0):
    ids = torch.randint(1, VOCAB, (len(PADS), PROMPT), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(len(PADS), PROMPT, dtype=torch.long)
    for row, pad in enumerate(PADS):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids, mask


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_sparse_op_equals_float64_reference_over_the_selection_on_a_left_padded_batch(monkeypatch, attn):
    """Budget 8 of 41..45 tokens, 3 left-padded rows, 5 decode steps x 2 layers: every call
    of the op equals the float64 hand reference over its own selected positions (causal
    limit, ``-1`` padding, padding mask), the op took the gather path (no dense shortcut:
    the budget does not cover the store), and no row's selection names a pad position."""
    seen = capture_sparse_calls(monkeypatch)
    model = tiny_family("llama", attn)
    ids, mask = left_padded_batch()
    sc.compile(model, budget=BUDGET, sink_tokens=SINK, recent_window=WINDOW, inner="eager")
    cache = sc.api.make_cache(model, ids, NEW_TOKENS)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0, cache=cache)
    steps = NEW_TOKENS - 1
    assert out.shape == (len(PADS), PROMPT + NEW_TOKENS)
    # the wrapped module attribute is what the op calls: one call per layer and decode step
    assert len(seen) == LAYERS * steps, len(seen)
    assert cache.path_counts()["gather_sites"] == LAYERS * steps
    assert cache.path_counts()["dense_store_sites"] == 0
    for n, call in enumerate(seen):
        step, layer = divmod(n, LAYERS)
        where = f"step {step} layer {layer}"
        q, idx, length = call["query"], call["indices"], call["length"]
        total = PROMPT + 1 + step  # tokens written, this step's included
        assert q.shape[:3] == (len(PADS), 4, 1) and q.dtype == torch.float32, where
        assert idx.shape == (len(PADS), 2, BUDGET), where
        assert int(length.max()) == int(length.min()) == total, where
        assert call["soft_cap"] is None and call["sliding_window"] == 0, where
        assert not aten_step.covers_store(idx, call["key_cache"]), where  # a real selection, not all slots
        # the mask the op got hides exactly each row's pad positions among the written ones
        assert call["attn_mask"] is not None, where
        for row, pad in enumerate(PADS):
            visible = [_mask_at(call["attn_mask"], row, 0, 0, p)[0] for p in range(total)]
            assert visible == [p >= pad for p in range(total)], f"{where} row {row}: mask {visible}"
        # selections: a set (the refinement keeps no order) of unique written positions, -1 padding
        for row in range(len(PADS)):
            for kv in range(2):
                sel = idx[row, kv].tolist()
                real = [p for p in sel if p >= 0]
                assert len(real) + sel.count(-1) == BUDGET, f"{where} row {row} kv {kv}: {sel}"
                assert len(set(real)) == len(real) and all(p < total for p in real), f"{where}: {sel}"
                assert total - 1 in real, f"{where}: the current token is always selected: {sel}"
        # padding-aware selection: no selected position is a pad position of its row
        for row, pad in enumerate(PADS):
            picked = idx[row][idx[row] >= 0]
            assert not (picked < pad).any(), f"{where} row {row} (pads 0..{pad - 1}) selected {picked.tolist()}"
        # the heavily padded row has fewer real tokens than the budget: -1 padding is exercised
        if step == 0:
            assert (idx[2] < 0).any(), f"{where}: row 2 ({total - PADS[2]} real tokens) should need -1 padding"
        expected = reference_attention(q, call["key_cache"], call["value_cache"], idx, length, call["attn_mask"],
                                       call["scale"])
        got = call["out"]
        assert torch.isfinite(got).all(), where
        torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=RTOL,
                                   msg=lambda m, where=where: f"{where}: {m}")


def test_reference_attention_matches_dense_sdpa_over_every_position():
    """The hand reference itself: with every written position selected it equals SDPA (the
    mask-free, unpadded case), and a -1 slot or a masked position changes nothing."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k, v = torch.randn(2, 2, 12, 16, generator=gen), torch.randn(2, 2, 12, 16, generator=gen)
    length = torch.tensor(10)
    every = torch.arange(10).expand(2, 2, 10)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :10], v[:, :, :10], enable_gqa=True)
    torch.testing.assert_close(reference_attention(q, k, v, every, length, None, 16**-0.5), dense.double(),
                               atol=1e-6, rtol=1e-6)
    padded = torch.cat([torch.full((2, 2, 2), -1), every], -1)
    torch.testing.assert_close(reference_attention(q, k, v, padded, length, None, 16**-0.5),
                               reference_attention(q, k, v, every, length, None, 16**-0.5))
    mask = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    mask[1, ..., :3] = False
    hidden = reference_attention(q, k, v, every, length, mask, 16**-0.5)
    torch.testing.assert_close(hidden[1], reference_attention(q[1:], k[1:], v[1:], every[1:, :, 3:], length, None,
                                                               16**-0.5)[0])
    additive = torch.where(mask, 0.0, float("-inf"))
    torch.testing.assert_close(reference_attention(q, k, v, every, length, additive, 16**-0.5), hidden)
