"""vLLM engines with the plugin on a tiny random Llama (4 layers, 4 query / 2 KV heads,
head_dim 64, fp32, eager, block 32; three requests of 300, 170 and 90 prompt tokens, 24 greedy
tokens each; retrieval layers 1 and 2).

* Budget covering every request: the decode rows run the plugin's path (its counters: every
  decode row of every layer served from a selection, none ranked by recency, prefill tokens on
  vLLM's kernel) and the tokens equal Hugging Face's greedy ones.
* Budget 48: the same path serves a sparse step (counters), and the options reach it.
* bfloat16 at full budget: the tokens equal vLLM's own dense run's.
* Prefix caching: a request reusing a cached prefix decodes as it does alone.
"""

import gc

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

from specontext_vllm.options import plugin_options

LAYERS, NEW = 4, 24
PROMPTS = (300, 170, 90)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=256, max_position_embeddings=1024,
        initializer_range=0.15, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPTS]


def _generate(folder, prompts, options, prefix_caching=False, one_by_one=False, dtype="float32"):
    """Greedy tokens of each prompt (all at once, or one ``generate`` call after the other) and
    the plugin's counters."""
    from vllm import LLM, SamplingParams

    counters["specontext_vllm"].clear()
    llm = LLM(model=folder, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, max_model_len=1024,
              block_size=32, max_num_seqs=4, kv_cache_memory_bytes=256 * 2**20, enable_prefix_caching=prefix_caching,
              additional_config={"specontext": options} if options is not None else {})
    params = SamplingParams(max_tokens=NEW, temperature=0.0, detokenize=False)
    try:
        batches = [[p] for p in prompts] if one_by_one else [prompts]
        outs = [o for batch in batches for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)]
        return [list(o.outputs[0].token_ids) for o in outs], dict(counters["specontext_vllm"])
    finally:
        del llm
        gc.collect()


def _hugging_face(folder, prompts):
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        out.append(model.generate(ids, max_new_tokens=NEW, do_sample=False)[0, len(p):].tolist())
    return out


def test_full_budget_is_vllm_dense_text_on_the_plugins_path(folder, prompts):
    tokens, stats = _generate(folder, prompts, {"budget": 4096, "retrieval_layers": [1, 2]})
    assert tokens == _hugging_face(folder, prompts)
    decode_steps = NEW - 1  # the first token comes from the prefill
    assert stats["selection_steps"] >= decode_steps
    assert stats["sparse_decode_rows"] == len(prompts) * decode_steps * LAYERS
    assert stats["recency_rows"] == 0  # every row's previous query was recorded (the prefill's last)
    assert stats["dense_prefill_tokens"] == sum(PROMPTS) * LAYERS


def test_bf16_full_budget_is_vllm_dense_text(folder, prompts):
    """bfloat16 (AMX tiles where the CPU has them): at a budget covering every request the
    plugin's tokens equal vLLM's own dense ones (the same kernel over every block, called per
    KV head), every decode row on the plugin's path."""
    dense, stats = _generate(folder, prompts, None, dtype="bfloat16")
    assert stats.get("sparse_decode_rows", 0) == 0  # no options: vLLM's attention unchanged
    tokens, stats = _generate(folder, prompts, {"budget": 4096, "retrieval_layers": [1, 2]}, dtype="bfloat16")
    assert tokens == dense
    assert stats["sparse_decode_rows"] == len(prompts) * (NEW - 1) * LAYERS and stats["recency_rows"] == 0


def test_a_small_budget_serves_sparse_rows(folder, prompts):
    tokens, stats = _generate(folder, prompts, {"budget": 48, "sink_tokens": 2, "recent_window": 8,
                                                "retrieval_layers": [1, 2]})
    assert [len(t) for t in tokens] == [NEW] * len(prompts)
    assert stats["sparse_decode_rows"] == len(prompts) * (NEW - 1) * LAYERS and stats["recency_rows"] == 0


def test_a_request_reusing_a_cached_prefix_decodes_as_alone(folder, prompts):
    """Prefix caching on: a second request sharing the first one's 256-token prefix reuses its
    KV blocks (and the queries recorded there); at budget 48 its tokens equal the same request
    served alone without prefix caching (its selection reads only its own previous token's
    record)."""
    options = {"budget": 48, "sink_tokens": 2, "recent_window": 8, "retrieval_layers": [1, 2]}
    first = prompts[0]
    second = first[:256] + prompts[1][:60]
    shared, stats = _generate(folder, [first, second], options, prefix_caching=True, one_by_one=True)
    alone, _ = _generate(folder, [second], options)
    assert shared[1] == alone[0]
    assert stats["recency_rows"] == 0 and stats["sparse_decode_rows"] == 2 * (NEW - 1) * LAYERS
    # the second prompt's prefill ran only past the cached prefix (vLLM's kernel)
    assert stats["dense_prefill_tokens"] < (len(first) + len(second)) * LAYERS


class _Config:
    def __init__(self, extra):
        self.additional_config = extra


def test_options_are_the_backends_and_unbuilt_ones_are_refused():
    assert plugin_options(_Config({})) is None
    assert plugin_options(_Config({"specontext": {"budget": 64}})).budget == 64
    with pytest.raises(ValueError, match="'budget' must be an int >= 1"):
        plugin_options(_Config({"specontext": {"budget": 0}}))
    with pytest.raises(ValueError, match="page_rescue=64 is not built in the vLLM plugin yet"):
        plugin_options(_Config({"specontext": {"page_rescue": 64}}))
    with pytest.raises(TypeError, match="must be a dict"):
        plugin_options(_Config({"specontext": 1024}))
