"""One multi-head latent attention (MLA) layer's decode step: Hugging Face's dense
up-projection vs dense absorbed attention vs our sparse absorbed op vs sparse
gather-then-up-project (the alternative runtime/mla.py rejects), side by side.

Shapes of DeepSeek-V2-Lite (16 heads, kv_lora_rank 512, rope 64, nope 128, value 128), fp32,
batch 1, one query token, eager torch ops on this machine's CPU; the median of ``--repeats``
timed calls after one warm-up. Bytes are what each contender must read or write (its
inputs, plus the per-head keys/values it materialises); the floor is those bytes at this
machine's measured copy rate. Every contender's output is checked against the dense one
(the sparse ones at a selection holding every position).

    python -m benchmarks.mla_attention --json docs/results/mla_attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from specontext_compile.runtime.mla import (
    gather_latent_keys,
    latent_query,
    mla_sparse_attention,
    split_kv_b_weight,
    up_project,
)
from specontext_compile.runtime.spec import AttentionVariant, StepSpec

from benchmarks.linear_bandwidth import _median_s as median_s

HEADS, RANK, ROPE, NOPE, VALUE = 16, 512, 64, 128, 128


def _median_s(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up call."""
    fn()
    return median_s(fn, repeats)


def hf_dense(query, latent, rope, weight, length, scale):
    """Hugging Face's ``expand_kv`` over the written store, then SDPA (its decode step)."""
    up = torch.nn.functional.linear(latent[:, :, :length], weight).view(1, length, HEADS, NOPE + VALUE).transpose(1, 2)
    k_nope, value = up.split([NOPE, VALUE], dim=-1)
    key = torch.cat([k_nope, rope[:, :, :length].expand(-1, HEADS, -1, -1)], dim=-1)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scale)


def absorbed_dense(query, latent, rope, weight, length, scale):
    """Multi-query attention in the latent space over the written store (what MLA decode
    kernels do densely): the heads are the rows of one product with the shared latent keys
    (no per-head copy), then the per-head value up-projection."""
    q = latent_query(query, weight, NOPE).transpose(1, 2)  # [1, 1, heads, r + p]
    keys = torch.cat([latent[:, :, :length], rope[:, :, :length]], dim=-1)  # [1, 1, length, r + p]
    probs = torch.softmax((q * scale) @ keys.transpose(-1, -2), dim=-1)  # [1, 1, heads, length]
    out = (probs @ latent[:, :, :length]).transpose(1, 2)  # [1, heads, 1, r]
    _, w_uv = split_kv_b_weight(weight, HEADS, NOPE)
    return torch.einsum("bhqr,hvr->bhqv", out, w_uv)


def sparse_absorbed(query, latent, rope, weight, length, scale, indices):
    """Ours: absorbed query, attention over the selected latent rows only."""
    latent_rows = mla_sparse_attention(latent_query(query, weight, NOPE), latent, rope, indices,
                                       torch.tensor(length), None, StepSpec(1, 1), AttentionVariant(scale))
    return up_project(latent_rows, weight, NOPE)


def sparse_up_projected(query, latent, rope, weight, length, scale, indices):
    """Gather the selected latent rows, up-project them to per-head keys/values, attend."""
    keys, rows = gather_latent_keys(latent, rope, indices)
    budget = rows.shape[2]
    up = torch.nn.functional.linear(rows, weight).view(1, budget, HEADS, NOPE + VALUE).transpose(1, 2)
    k_nope, value = up.split([NOPE, VALUE], dim=-1)
    key = torch.cat([k_nope, keys[..., RANK:].expand(-1, HEADS, -1, -1)], dim=-1)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scale)


def bytes_moved(tokens: int, element: int = 4) -> dict[str, int]:
    """Bytes read or written per contender for ``tokens`` attended rows."""
    latent_rows = tokens * (RANK + ROPE)
    weight = HEADS * (NOPE + VALUE) * RANK
    per_head_kv = tokens * HEADS * (NOPE + ROPE + VALUE)
    return {"latent rows": latent_rows * element, "kv_b_proj weight": weight * element,
            "per-head K/V written and read": 2 * per_head_kv * element}


def run(context: int, budget: int, repeats: int, copy_gbps: float) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, HEADS, 1, NOPE + ROPE, generator=g)
    latent = torch.randn(1, 1, context, RANK, generator=g)
    rope = torch.randn(1, 1, context, ROPE, generator=g)
    weight = torch.randn(HEADS * (NOPE + VALUE), RANK, generator=g) / RANK**0.5
    scale = (NOPE + ROPE) ** -0.5
    every = torch.arange(context).view(1, 1, context)
    picked = torch.randperm(context - 1, generator=g)[: budget - 1].sort().values
    indices = torch.cat([picked, torch.tensor([context - 1])]).view(1, 1, budget)
    ref = hf_dense(query, latent, rope, weight, context, scale)
    for fn in (absorbed_dense, lambda *a: sparse_absorbed(*a, every), lambda *a: sparse_up_projected(*a, every)):
        torch.testing.assert_close(fn(query, latent, rope, weight, context, scale), ref, atol=2e-4, rtol=2e-4)
    rows = []
    cases = [("hf-dense-up-projection", context, True, lambda: hf_dense(query, latent, rope, weight, context, scale)),
             ("dense-absorbed", context, False, lambda: absorbed_dense(query, latent, rope, weight, context, scale)),
             (f"specontext-sparse-absorbed-{budget}", budget, False,
              lambda: sparse_absorbed(query, latent, rope, weight, context, scale, indices)),
             (f"sparse-up-projected-{budget}", budget, True,
              lambda: sparse_up_projected(query, latent, rope, weight, context, scale, indices))]
    with torch.no_grad():
        for name, tokens, materialises, fn in cases:
            parts = bytes_moved(tokens)
            if not materialises:
                parts.pop("per-head K/V written and read")
            total = sum(parts.values())
            seconds = _median_s(fn, repeats)
            rows.append({"contender": name, "context": context, "attended_tokens": tokens, "ms": seconds * 1e3,
                         "bytes": total, "bytes_parts": parts, "floor_ms": total / (copy_gbps * 1e9) * 1e3})
    return rows


def copy_rate_gbps() -> float:
    """Read + write rate of a 256 MB fp32 copy (bytes moved per second / 1e9)."""
    src = torch.randn(64 * 2**20)
    dst = torch.empty_like(src)
    seconds = _median_s(lambda: dst.copy_(src), 5)
    return 2 * src.numel() * 4 / seconds / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    gbps = copy_rate_gbps()
    rows = [r for c in args.contexts for r in run(c, args.budget, args.repeats, gbps)]
    print(f"copy rate {gbps:.1f} GB/s; {torch.get_num_threads()} threads; fp32; DeepSeek-V2-Lite MLA shapes")
    print(f"{'context':>7} {'contender':<36} {'ms':>8} {'MB moved':>9} {'floor ms':>9}")
    for r in rows:
        print(f"{r['context']:>7} {r['contender']:<36} {r['ms']:8.3f} {r['bytes'] / 1e6:9.2f} {r['floor_ms']:9.3f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"command": "python -m benchmarks.mla_attention " + " ".join(argv or sys.argv[1:]),
                "torch": torch.__version__, "threads": torch.get_num_threads(), "copy_gbps": gbps,
                "shapes": {"heads": HEADS, "kv_lora_rank": RANK, "rope": ROPE, "nope": NOPE, "value": VALUE}}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
