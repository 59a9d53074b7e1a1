"""The rewrite fires exactly where it is exact: hand-written attention variants."""

import pytest
import torch

import specontext_compile as sc


class HandWritten(torch.nn.Module):
    """One attention layer over a SpeContextCache, written out by hand in some variant."""

    def __init__(self, variant: str, heads: int = 4, kv_heads: int = 2, dim: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.variant, self.heads, self.kv_heads, self.dim = variant, heads, kv_heads, dim
        self.q = torch.nn.Linear(16, heads * dim, bias=False)
        self.kv = torch.nn.Linear(16, 2 * kv_heads * dim, bias=False)

    def forward(self, x, cache):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.dim).permute(2, 0, 3, 1, 4)
        keys, values = cache.update(k, v, 0)
        g = self.heads // self.kv_heads
        keys = keys[:, :, None, :, :].expand(b, self.kv_heads, g, *keys.shape[2:]).reshape(b, self.heads, *keys.shape[2:])
        values = values[:, :, None, :, :].expand(b, self.kv_heads, g, *values.shape[2:]).reshape(b, self.heads, *values.shape[2:])
        mask = self.mask  # [1, 1, s, capacity] additive
        scale = self.dim**-0.5
        if self.variant in ("expand_tiled", "repeat_interleave"):  # GQA spelled differently
            keys, values = cache.layers[0].keys, cache.layers[0].values
            if self.variant == "expand_tiled":  # query head i reads KV head i % kv_heads: not HF's order
                keys = keys[:, None].expand(b, g, *keys.shape[1:]).reshape(b, self.heads, *keys.shape[2:])
                values = values[:, None].expand(b, g, *values.shape[1:]).reshape(b, self.heads, *values.shape[2:])
            else:  # same mapping as repeat_kv, another op
                keys, values = keys.repeat_interleave(g, dim=1), values.repeat_interleave(g, dim=1)
            w = torch.softmax(torch.matmul(q, keys.transpose(2, 3)) * scale + mask, dim=-1)
        elif self.variant == "nan_safe_where":  # NaN-safe softmax (fully masked rows -> 0)
            w = torch.softmax(torch.matmul(q, keys.transpose(2, 3)) * scale + mask, dim=-1)
            w = torch.where(torch.isnan(w), torch.zeros_like(w), w)
        elif self.variant == "where_mask_before_softmax":
            scores = torch.matmul(q, keys.transpose(2, 3)) * scale
            w = torch.softmax(torch.where(mask == 0, scores, torch.full_like(scores, -1e9)), dim=-1)
        elif self.variant == "mask_fp16":  # additive mask in another dtype than q/k/v: exact
            w = torch.softmax(torch.matmul(q, keys.transpose(2, 3)) * scale + mask.half(), dim=-1)
        elif self.variant == "mask_bool_added":  # adds 0/1, not an attention mask
            w = torch.softmax(torch.matmul(q, keys.transpose(2, 3)) * scale + (mask == 0), dim=-1)
        elif self.variant == "good":
            w = torch.softmax(torch.matmul(q, keys.transpose(2, 3)) * self.dim**-0.5 + mask, dim=-1)
        elif self.variant == "permuted_key":  # same values as transpose(2, 3), another op
            w = torch.softmax(torch.matmul(q, keys.permute(0, 1, 3, 2)) * self.dim**-0.5 + mask, dim=-1)
        elif self.variant == "softmax_other_dim":
            w = torch.softmax(torch.matmul(q, keys.transpose(2, 3)) * self.dim**-0.5 + mask, dim=-2)
        elif self.variant == "mask_after_softmax":
            w = torch.softmax(torch.matmul(q, keys.transpose(2, 3)) * self.dim**-0.5, dim=-1) + mask
        elif self.variant == "weights_reused":
            w = torch.softmax(torch.matmul(q, keys.transpose(2, 3)) * self.dim**-0.5 + mask, dim=-1)
            return torch.matmul(w, values), w.sum(-1)
        else:
            raise ValueError(self.variant)
        return torch.matmul(w, values)


def run_variant(variant, dynamic=None):
    model = HandWritten(variant)
    cap = 32
    x_prefill, x_step = torch.randn(1, 10, 16), torch.randn(1, 1, 16)

    def step_mask(length, q_len):
        m = torch.full((1, 1, q_len, cap), float("-inf"))
        for r in range(q_len):
            m[..., r, : length - q_len + r + 1] = 0.0
        return m

    outputs = []
    for forward in (model.forward, torch.compile(model.forward, backend="specontext", options={"budget": 64},
                                                     dynamic=dynamic)):
        config = type("Config", (), {"num_hidden_layers": 1, "num_attention_heads": 4, "head_dim": 8})()
        cache = sc.SpeContextCache(config, max_cache_len=cap, chunk_tokens=cap)
        with torch.no_grad():
            model.mask = step_mask(10, 10)
            forward(x_prefill, cache)
            model.mask = step_mask(11, 1)
            outputs.append(forward(x_step, cache))
    return outputs, sc.compile_reports()


def test_positive_control_is_rewritten_and_exact():
    (eager, compiled), reports = run_variant("good")
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    assert any(r.sites_rewritten == 1 for r in reports)


@pytest.mark.parametrize("variant", ["permuted_key", "softmax_other_dim", "mask_after_softmax", "weights_reused"])
def test_rewrite_does_not_fire_where_it_must_not(variant):
    (eager, compiled), reports = run_variant(variant)
    assert all(r.sites_rewritten == 0 for r in reports)
    eager_t = eager if isinstance(eager, torch.Tensor) else torch.cat([t.flatten() for t in eager])
    compiled_t = compiled if isinstance(compiled, torch.Tensor) else torch.cat([t.flatten() for t in compiled])
    torch.testing.assert_close(compiled_t, eager_t, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("variant", ["expand_tiled", "repeat_interleave", "nan_safe_where",
                                     "where_mask_before_softmax", "mask_bool_added"])
def test_other_spellings_stay_dense_and_exact(variant):
    """GQA by another expansion, NaN-safe ``where`` after softmax, a ``where`` mask, a bool
    mask added to the scores: not rewritten (a reason is given where a site is seen)."""
    (eager, compiled), reports = run_variant(variant)
    assert all(r.sites_rewritten == 0 for r in reports)
    assert all(reason for r in reports for _, reason in r.result.fallbacks())
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


def test_tiled_gqa_expansion_is_seen_and_explained():
    _, reports = run_variant("expand_tiled")
    reasons = {reason for r in reports for _, reason in r.result.fallbacks()}
    assert any("unrecognised expansion" in reason for reason in reasons), reasons


def test_mask_in_another_dtype_is_rewritten_and_exact():
    (eager, compiled), reports = run_variant("mask_fp16")
    assert any(r.sites_rewritten == 1 for r in reports)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # fast tier: test_never_silent.py::test_budget_above_a_symbolic_store_is_exact[eager]
def test_dynamic_shapes_with_symbolic_sizes_stay_exact():
    """``dynamic=True`` on a tiny Llama: sizes and even head counts become symbols
    (``SymInt`` graph inputs); whatever is not provably constant stays dense with a reason,
    and the logits stay exact."""
    from _tiny import tiny_llama
    from test_backend_e2e import decode_logits
    from transformers import DynamicCache

    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    eager = decode_logits(model, model.forward, ids, 4, DynamicCache(config=model.config))
    compiled = torch.compile(model.forward, backend="specontext", options={"budget": 64}, dynamic=True)
    out = decode_logits(model, compiled, ids, 4, sc.SpeContextCache(model.config, max_cache_len=40))
    for a, b in zip(out, eager):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    reports = sc.compile_reports()
    assert any("SymInt" in r.graph_module.code for r in reports), "no symbolic sizes: test is moot"
    for r in reports:
        assert all(reason for _, reason in r.result.fallbacks())
        assert r.result.rewritten + len(r.result.fallbacks()) == r.result.total


def test_dead_code_elimination_keeps_store_writes_even_where_fx_calls_them_pure(monkeypatch):
    """torch 2.11's FX took ``torch.ops.specontext.kv_write(...)`` (an op packet, as dynamo
    records it) for pure and dropped every KV write of the decode graph; the pass's own test
    keeps any op whose schema mutates, and still drops unused pure ops."""
    import specontext_compile.runtime.ops  # noqa: F401  (registers the ops)
    from specontext_compile.passes.sparse_rewrite import keeps_side_effects
    from torch import fx

    graph = fx.Graph()
    k, v, n, nk, nv = (graph.placeholder(name) for name in ("k", "v", "n", "nk", "nv"))
    write = graph.call_function(torch.ops.specontext.kv_write, (k, v, n, nk, nv, []))
    unused = graph.call_function(torch.ops.aten.add.Tensor, (k, v))
    graph.output(None)
    monkeypatch.setattr(fx.Node, "is_impure", lambda self, *a, **kw: self.op in ("placeholder", "output"))
    graph.eliminate_dead_code(is_impure_node=keeps_side_effects)
    nodes = list(graph.nodes)
    assert write in nodes and unused not in nodes
    graph.eliminate_dead_code()  # FX alone (as on torch 2.11) would drop the write
    assert write not in list(graph.nodes)


def test_step_functions_that_change_state_are_impure_to_fx_itself():
    """The step functions the pass calls directly and that change tensors in place are
    registered with ``torch.fx.node.has_side_effect``: FX's own dead-code elimination (no
    predicate of ours) keeps a call whose result is unused, and still removes an unused
    pure step function (``load_selection``)."""
    from torch import fx

    from specontext_compile.runtime import aten_step, page_bounds, rollback

    mutating = (aten_step.record_query, aten_step.record_hidden, aten_step.count_step, aten_step.count_fallback,
                aten_step.count_guard, aten_step.store_selection, page_bounds.shift_from_mask,
                page_bounds.update_after_write, rollback.record_rows, rollback.restore)
    graph = fx.Graph()
    state = graph.placeholder("state")
    calls = [graph.call_function(fn, (state,)) for fn in mutating]
    pure = graph.call_function(aten_step.load_selection, (state, 4))
    graph.output(None)
    graph.eliminate_dead_code()
    nodes = list(graph.nodes)
    assert all(call in nodes for call in calls), [c.target.__name__ for c in calls if c not in nodes]
    assert pure not in nodes
