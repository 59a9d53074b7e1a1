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
        self.side = None

    def forward(self, x, cache):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.dim).permute(2, 0, 3, 1, 4)
        keys, values = cache.update(k, v, 0)
        g = self.heads // self.kv_heads
        keys = keys[:, :, None, :, :].expand(b, self.kv_heads, g, *keys.shape[2:]).reshape(b, self.heads, *keys.shape[2:])
        values = values[:, :, None, :, :].expand(b, self.kv_heads, g, *values.shape[2:]).reshape(b, self.heads, *values.shape[2:])
        mask = self.mask  # [1, 1, s, capacity] additive
        if self.variant == "good":
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


def run_variant(variant):
    model = HandWritten(variant)
    cap = 32
    x_prefill, x_step = torch.randn(1, 10, 16), torch.randn(1, 1, 16)

    def step_mask(length, q_len):
        m = torch.full((1, 1, q_len, cap), float("-inf"))
        for r in range(q_len):
            m[..., r, : length - q_len + r + 1] = 0.0
        return m

    outputs = []
    for forward in (model.forward, torch.compile(model.forward, backend="specontext", options={"budget": 64})):
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
