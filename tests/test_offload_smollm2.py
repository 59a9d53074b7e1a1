"""KV offload on the real SmolLM2-135M: offload on vs off, identical logits (slow)."""

import pydoc_data.topics

import pytest
import torch
from torch._dynamo.utils import counters

import specontext_compile as sc
from specontext_compile.runtime.offload import enable_offload

pytestmark = pytest.mark.slow

PROMPT, STEPS, BUDGET = 400, 50, 128


def _run(forward, cache, ids, steps, after_prefill=None):
    out = []
    with torch.no_grad():
        logits = forward(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        out.append(logits)
        if after_prefill is not None:
            after_prefill()
        for _ in range(steps):
            logits = forward(input_ids=logits.argmax(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1]
            out.append(logits)
    return out


def test_smollm2_offload_on_vs_off_identical_logits_for_50_steps(smollm2):
    model, tokenizer = smollm2
    text = pydoc_data.topics.topics["nonlocal"] + pydoc_data.topics.topics["global"] * 4
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :PROMPT]
    assert ids.shape[1] == PROMPT
    # the same eager step with and without offload (page_rescue=0: every transfer prefetched)
    opts = {"budget": BUDGET, "inner": "eager", "page_rescue": 0}
    cap = PROMPT + STEPS + 1
    ref = _run(torch.compile(model.forward, backend="specontext", options=opts),
               sc.SpeContextCache(model.config, max_cache_len=cap), ids, STEPS)
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend="specontext",
                            options=dict(opts, device_memory_bytes=1 << 40))
    cache = sc.SpeContextCache(model.config, max_cache_len=cap)
    manager = enable_offload(cache, model, 1 << 40, BUDGET)

    def size_device_tier():  # 10 of 30 layers must leave at the first decode step
        mm = manager.prepare()
        manager.prepare(mm.device_bytes(PROMPT + 1, 10))

    out = _run(forward, cache, ids, STEPS, after_prefill=size_device_tier)
    for step, (a, b) in enumerate(zip(out, ref)):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"decode call {step}")
    assert manager.offloaded[:10] == list(range(29, 19, -1))
    assert counters["specontext"]["offloaded_attention_calls"] >= 10 * STEPS
    later = manager.stats[1:]
    assert sum(s.bytes_elastic for s in later) < sum(s.bytes_full_reload for s in later)
