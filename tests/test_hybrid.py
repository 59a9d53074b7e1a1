"""Hybrid models (attention layers interleaved with convolution / linear-attention layers,
issue 14 item 3): SpeContextCache builds Hugging Face's own cache layer for every layer
without a KV store (as its StaticCache does), and stores, selection and rewrite only for the
attention layers. Checked on tiny LFM2 (conv + attention) and Qwen3-Next (gated delta-net
linear attention + attention, MoE): eager equals Hugging Face's cache; compiled at full
budget on the gather path equals eager; at a small budget the attention layers run sparse
with the same logits as the StaticCache path (one selection code, two caches)."""

import pytest
import torch
from test_backend_e2e import decode_logits
from transformers import AutoConfig, AutoModelForCausalLM, StaticCache

import specontext_compile as sc
from specontext_compile.backend import compile_reports

COMMON = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256}
FAMILIES = {
    "lfm2": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
                       "head_dim": 16, "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                       "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                       "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1},
}
STEPS, PROMPT, CAP = 4, 30, 40


def _model(family):
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **COMMON, **FAMILIES[family])
    return AutoModelForCausalLM.from_config(config).eval()


def _decode(forward, cache, ids):
    """Prefill + STEPS greedy steps; logits of every call ``[calls, batch, vocab]``."""
    return torch.stack(decode_logits(None, forward, ids, STEPS, cache))


@pytest.fixture(params=list(FAMILIES))
def family(request):
    return request.param


def test_layers_follow_hugging_faces_layout(family):
    model = _model(family)
    cache = sc.SpeContextCache(model.config, max_cache_len=CAP)
    kinds = FAMILIES[family]["layer_types"]
    assert cache.kv_layer_indices == [i for i, k in enumerate(kinds) if k == "full_attention"]
    hf = StaticCache(config=model.config, max_cache_len=CAP)
    for i, kind in enumerate(kinds):
        if kind != "full_attention":  # Hugging Face's own class for the non-attention state
            assert type(cache.layers[i]) is type(hf.layers[i])
    assert cache.layer_windows == [0, 0]


def test_eager_and_full_budget_gather_path_equal_hugging_face(family):
    model = _model(family)
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    want = _decode(model.forward, StaticCache(config=model.config, max_cache_len=CAP), ids)
    eager = _decode(model.forward, sc.SpeContextCache(model.config, max_cache_len=CAP), ids)
    torch.testing.assert_close(eager, want, atol=1e-5, rtol=1e-5)
    forward = torch.compile(model.forward, backend="specontext",
                            options={"budget": 64, "dense_shortcut": False, "inner": "eager"})
    cache = sc.SpeContextCache(model.config, max_cache_len=CAP)
    got = _decode(forward, cache, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert [(r.result.phase, r.result.rewritten, r.result.total) for r in compile_reports()[-2:]] == [
        ("prefill", 0, 2), ("decode", 2, 2)]
    counts = cache.path_counts()
    assert counts["gather_sites"] == counts["sparse_sites"] == STEPS * 2 and counts["dense_store_sites"] == 0


def test_small_budget_runs_sparse_on_attention_layers_like_the_static_cache_path(family):
    model = _model(family)
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    # page_rescue=0: the static-cache path keeps no page bounds, so only ours could rescue
    opts = {"budget": 12, "recent_window": 3, "sink_tokens": 2, "inner": "eager", "page_rescue": 0}
    cache = sc.SpeContextCache(model.config, max_cache_len=CAP)
    ours = _decode(torch.compile(model.forward, backend="specontext", options=opts), cache, ids)
    hf_cache = StaticCache(config=model.config, max_cache_len=CAP)
    static = _decode(torch.compile(model.forward, backend="specontext", options=opts), hf_cache, ids)
    assert cache.path_counts()["gather_sites"] == STEPS * 2
    assert sc.path_counts(hf_cache)["gather_sites"] == STEPS * 2
    assert sc.path_counts(model)["gather_sites"] == 2 * STEPS * 2  # both caches' steps
    torch.testing.assert_close(ours, static, atol=1e-5, rtol=1e-5)
    dense = _decode(model.forward, StaticCache(config=model.config, max_cache_len=CAP), ids)
    assert (ours - dense).abs().max() > 1e-4  # a budget of 12 of 30+ tokens really sparsified


def test_unsupported_combinations_are_refused_with_the_fix(family):
    model = _model(family)
    from specontext_compile.runtime.offload import enable_offload

    cache = sc.SpeContextCache(model.config, max_cache_len=CAP)
    with pytest.raises(ValueError, match="hybrid model"):
        enable_offload(cache, None, 1 << 40, 16)
    with pytest.raises(ValueError, match="hybrid model"):
        cache.batch_select_indices(torch.tensor([0]))
    with pytest.raises(ValueError, match="retrieval_head with a hybrid model"):
        sc.SpeContextCache(model.config, max_cache_len=CAP, retrieval_head="smollm2-135m-embedding")
