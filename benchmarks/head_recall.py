"""Which training-free retrieval head covers the most attention? (docs/design.md)

Prefills SmolLM2-135M with the first ``--tokens`` tokens of ``pydoc_data.topics``, decodes
``--steps`` more tokens of the same text one by one with dense attention, records every
layer's query and key cache at each step, and reports the attention recall (share of each
layer/head's dense attention mass inside the selection, averaged over layers, heads and
steps) of candidate selections at one budget. Every candidate keeps the same sinks and
recent window inside the budget, so all attend to the same number of tokens.

    python -m benchmarks.head_recall --tokens 6000 --budget 1024
"""

from __future__ import annotations

import argparse
import pydoc_data.topics

import torch
from specontext_compile.runtime.retrieval import group_max_softmax
from benchmarks.host_selection import select_tokens
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specontext_compile.models import load_model


def record_decode(model, ids, steps):
    """Per decode step: {layer: (query [1,H,1,D], keys [1,Hkv,S,D])}."""
    records, current = [], {}

    def recording_attention(module, q, k, v, mask, **kw):
        if q.shape[2] == 1:
            current[module.layer_idx] = (q.detach(), k.detach())
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("specontext_recording", recording_attention)
    model.set_attn_implementation("specontext_recording")
    cache = DynamicCache(config=model.config)
    n = ids.shape[1] - steps
    with torch.no_grad():
        model(ids[:, :n], cache=cache, use_cache=True)
        for i in range(n, ids.shape[1]):
            current.clear()
            model(ids[:, i : i + 1], cache=cache, use_cache=True)
            records.append(dict(current))
    model.set_attn_implementation("sdpa")
    return records


def embedding_head_scores(model, ids, layer, length):
    """Paper-shaped training-free head: target layer ``layer``'s norm + Q/K on embeddings."""
    block = model.model.layers[layer]
    attn = block.self_attn
    x = block.input_layernorm(model.model.embed_tokens(ids[:, :length]))
    d = attn.head_dim
    q = attn.q_proj(x[:, -1:]).view(1, 1, -1, d).transpose(1, 2)
    k = attn.k_proj(x).view(1, length, -1, d).transpose(1, 2)
    cos, sin = model.model.rotary_emb(x, torch.arange(length)[None])
    q, _ = apply_rotary_pos_emb(q, q, cos[:, -1:], sin[:, -1:])
    _, k = apply_rotary_pos_emb(k, k, cos, sin)
    return group_max_softmax(q, k, attn.scaling)[0]


def recall(selection, query, keys, scale):
    """Mean dense attention mass inside ``selection`` [Hkv, budget] for one layer."""
    probs = torch.softmax((query.double() @ keys.double().repeat_interleave(
        query.shape[1] // keys.shape[1], 1).transpose(-1, -2)) * scale, -1)[0, :, 0]
    mask = torch.zeros(keys.shape[1], keys.shape[2] + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(selection >= 0, selection, keys.shape[2]), True)
    mask = mask[:, :-1].repeat_interleave(query.shape[1] // keys.shape[1], 0)
    return float((probs * mask).sum(-1).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--window", type=int, default=64)
    args = parser.parse_args()
    model, tok = load_model("smollm2-135m")
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tok(text, return_tensors="pt").input_ids[:, : args.tokens]
    steps = record_decode(model, ids, args.steps)
    layers = len(model.model.layers)
    scale = model.model.layers[0].self_attn.scaling
    results: dict[str, list[float]] = {}

    def evaluate(name, scores, step, length):
        sel = select_tokens(scores[None, :, : length - 1], length, 1, args.budget, args.sink, args.window)[0]
        value = sum(recall(sel, *step[l], scale) for l in range(layers)) / layers
        results.setdefault(name, []).append(value)

    with torch.no_grad():
        for i, step in enumerate(steps):
            length = step[0][1].shape[2]
            num_kv = step[0][1].shape[1]
            evaluate("sink + recent window only", torch.arange(length, dtype=torch.float).expand(num_kv, -1), step, length)
            for j in (0, 2, 8, 15, 29):
                evaluate(f"embedding head, layer {j} Q/K", embedding_head_scores(model, ids, j, length), step, length)
            if i > 0:
                lagged = {
                    j: group_max_softmax(steps[i - 1][j][0], step[j][1], scale)[0] for j in range(layers)
                }
                for j in (2, 4, 8, 12, 20):
                    evaluate(f"lagged query, layer {j}", lagged[j], step, length)
                five = [lagged[j] for j in (2, 4, 8, 12, 20)]
                evaluate("lagged queries 2,4,8,12,20 summed", sum(five), step, length)
                evaluate("lagged queries 2,4,8,12,20 max", torch.stack(five).amax(0), step, length)
                evaluate("lagged queries, all layers summed", sum(lagged.values()), step, length)
            oracle = torch.stack([group_max_softmax(*step[l], scale)[0] for l in range(layers)]).mean(0)
            evaluate("oracle: one selection for all layers", oracle, step, length)
    print(f"attention recall, SmolLM2-135M, {args.tokens} tokens, budget {args.budget}, "
          f"sink {args.sink}, window {args.window}, {args.steps} decode steps")
    for name, values in results.items():
        print(f"{name:40s} {sum(values) / len(values):.4f}")


if __name__ == "__main__":
    main()
