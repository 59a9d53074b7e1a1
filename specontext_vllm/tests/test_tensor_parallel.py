"""Tensor parallelism (issue 54, item 4): 2 ranks give the tokens of 1 rank.

vLLM shards attention by heads: with 2 ranks each holds one of the tiny Llama's 2 KV heads and
its 2 query heads, and its own KV cache blocks for that head. The selection is per request and
KV head (the group-max over that KV head's query heads, summed over retrieval layers), so each
rank selects for its own heads from what it holds: no communication is added; so does the
per-layer refinement (``page_rescue``, ``candidates > 1``: the rescued blocks and the kept tokens
per request and KV head). Slow tier (two engine starts with worker processes per case, ~70 s
on 2 cores): ``.venv-vllm/bin/python -m pytest -m
slow specontext_vllm/tests`` (``tests/test_vllm_plugin.py`` runs it in the main suite's slow tier).
"""

import gc

import pytest
import torch

from specontext_vllm import worker_counters

LAYERS, NEW, PROMPTS = 4, 24, (300, 170, 90)  # LAYERS: the conftest's tiny Llama (fixture `folder`)
OPTIONS = {"budget": 48, "sink_tokens": 2, "recent_window": 8, "retrieval_layers": [1, 2]}
REFINED = {**OPTIONS, "page_rescue": 64, "candidates": 2}

pytestmark = pytest.mark.slow


def _run(folder, ranks, monkeypatch, options):
    from torch._dynamo.utils import counters
    from vllm import LLM, SamplingParams, envs

    counters["specontext_vllm"].clear()  # one rank counts in this process
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if ranks == 2 else "0-1")  # a core per rank
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # worker_counters crosses to the ranks
    envs.disable_envs_cache()  # an earlier engine in this process froze vLLM's environment
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPTS]
    llm = LLM(model=folder, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=1024,
              block_size=32, max_num_seqs=4, kv_cache_memory_bytes=64 * 2**20, tensor_parallel_size=ranks,
              additional_config={"specontext": options})
    try:
        params = SamplingParams(max_tokens=NEW, temperature=0.0, detokenize=False, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm.collective_rpc(worker_counters)
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize("options", [OPTIONS, REFINED], ids=["shared", "refined"])
def test_two_ranks_give_the_tokens_of_one_each_rank_on_the_plugins_path(folder, monkeypatch, options):
    one, [single] = _run(folder, 1, monkeypatch, options)
    two, per_rank = _run(folder, 2, monkeypatch, options)
    assert two == one
    assert len(per_rank) == 2
    rows = len(PROMPTS) * (NEW - 1) * LAYERS
    for stats in (single, *per_rank):  # every rank served every decode row of every layer sparse
        assert stats["sparse_decode_rows"] == rows
        assert stats["recency_rows"] == 0
        assert stats.get("refined_rows", 0) == (rows if options is REFINED else 0)
