"""Sparse decoding inside Hugging Face's continuous batching (issue 28): ``serving.py``,
``passes/paged.py``, ``runtime/paged.py``. A tiny random Llama (4 layers, GQA 4/2), three
requests of different lengths; the step runs eagerly (the compiled step is the same graph)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

import specontext_compile as sc
from specontext_compile import serving
from specontext_compile.passes.paged import find_paged_sites
from specontext_compile.runtime import paged
from specontext_compile.runtime.spec import StepSpec

pytestmark = pytest.mark.xdist_group("test_serving")  # its module fixture is built once: one worker runs the module (--dist loadgroup)

LAYERS, NEW = 4, 8
ENGINE = dict(block_size=16, num_blocks=32, max_batch_tokens=128, max_requests_per_batch=4)
OPTIONS = {"inner": "eager", "sink_tokens": 2, "recent_window": 4, "page_rescue": 0}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval().to(torch.float32)


def prompts(*lengths):
    return [torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


def generate(model, inputs, cb_config):
    gen = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)
    out = model.generate_batch(inputs=inputs, generation_config=gen, continuous_batching_config=cb_config)
    assert all(out[f"req_{i}"].error is None for i in range(len(inputs))), [o.error for o in out.values()]
    return [out[f"req_{i}"].generated_tokens for i in range(len(inputs))]


def test_full_budget_decodes_sparse_and_equals_dense_continuous_batching(model):
    inputs = prompts(40, 25, 60)
    dense = generate(model, inputs, ContinuousBatchingConfig(auto_switch_to_flash=False, **ENGINE))
    cb = sc.continuous_batching_config(model, {"budget": 1000, **OPTIONS}, **ENGINE)
    assert generate(model, inputs, cb) == dense
    counts = serving.path_counts(cb)
    # one prefill step (dense, Hugging Face's graph), then NEW - 1 decode steps, all sparse
    assert counts["sparse_steps"] == NEW - 1 and counts["sparse_sites"] == (NEW - 1) * LAYERS, counts
    assert counts["dense_steps"] >= 1 and counts["recency_rows"] == 0, counts


#: the selections built: the shared one; per-layer refinement of 40 candidates to 16; the page
#: rescue (2 pages of 16 tokens per layer, refined to 16) at blocks of 16 and of 32 tokens
SELECTIONS = {
    "shared": ({"candidates": 1.0}, 16),
    "refined": ({"candidates": 2.5}, 16),
    "rescue": ({"page_rescue": 32}, 16),
    "rescue-blocks-32": ({"page_rescue": 32}, 32),
}


def _selection(name: str) -> tuple[dict, dict]:
    extra, block = SELECTIONS[name]
    options = {**OPTIONS, "budget": 16, **extra}
    return options, {**ENGINE, "block_size": block, "num_blocks": ENGINE["num_blocks"] * 16 // block}


def _check_paths(counts: dict, options: dict) -> None:
    """The sites ran the path the options name: refined (more candidates or the rescue), rescued."""
    refines = options.get("candidates", 1.0) > 1 or options["page_rescue"] > 0
    assert counts["refined_sites"] == (counts["sparse_sites"] if refines else 0), counts
    assert counts["rescued_sites"] == (counts["sparse_sites"] if options["page_rescue"] else 0), counts


def _solo(model, inputs, options) -> list[list[int]]:
    """Each prompt alone through ``sc.compile`` (the one-request step), its gather path counted."""
    torch._dynamo.reset()
    out = []
    try:
        sc.compile(model, **options)
        for prompt in inputs:
            cache = sc.SpeContextCache(model.config, max_cache_len=len(prompt) + NEW + 1)
            out.append(model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, cache=cache,
                                      pad_token_id=0)[0, len(prompt):].tolist())
            assert cache.path_counts()["gather_sites"] == (NEW - 1) * LAYERS
    finally:
        sc.restore(model)
        torch._dynamo.reset()
    return out


@pytest.mark.parametrize("selection", [name if name in ("shared", "rescue") else pytest.param(name, marks=pytest.mark.slow)
                                       for name in SELECTIONS])
def test_small_budget_each_request_decodes_as_alone_through_the_one_request_backend(model, selection):
    """At a budget far below the contexts, each request of the batch gets the tokens of the
    same request run alone through ``sc.compile`` (the one-request step: same selection,
    same per-layer refinement, same rescued pages)."""
    inputs = prompts(40, 25, 60)
    options, engine = _selection(selection)
    dense = generate(model, inputs, ContinuousBatchingConfig(auto_switch_to_flash=False, **engine))
    cb = sc.continuous_batching_config(model, options, **engine)
    batched = generate(model, inputs, cb)
    counts = serving.path_counts(cb)
    assert counts["sparse_steps"] == NEW - 1
    _check_paths(counts, options)
    assert batched == _solo(model, inputs, options)
    assert batched != dense  # the budget changed the text: the sparse path was exercised


def test_the_page_rescue_changes_what_a_batched_request_attends_to(model):
    """The rescue's comparison above is not vacuous: without it, the same requests decode
    otherwise (so equal tokens mean the batched step rescued the same pages as alone)."""
    inputs = prompts(40, 25, 60)
    options, engine = _selection("rescue")
    plain = generate(model, inputs, sc.continuous_batching_config(model, {**options, "page_rescue": 0}, **engine))
    assert plain != generate(model, inputs, sc.continuous_batching_config(model, options, **engine))


@pytest.mark.parametrize("page_rescue", [pytest.param(0, marks=pytest.mark.slow), 32])
def test_requests_joining_and_leaving_reuse_blocks_and_keep_their_own_text(model, page_rescue):
    """Two requests at a time: the third joins when one finishes, in blocks another request
    used (their lagged queries and page bounds are the former owner's until overwritten);
    every request's tokens equal its run alone through the same engine settings."""
    inputs = prompts(40, 25, 60)  # 3 + 3 + 5 blocks of 16 with their outputs: more than the 10 there are
    engine = {**ENGINE, "max_requests_per_batch": 2, "num_blocks": 10}
    options = {"budget": 16, **OPTIONS, "page_rescue": page_rescue}
    cb = sc.continuous_batching_config(model, options, **engine)
    batched = generate(model, inputs, cb)
    counts = serving.path_counts(cb)
    assert counts["sparse_steps"] == 2 * (NEW - 1) and counts["recency_rows"] == 0, counts  # two waves
    _check_paths(counts, options)  # with the rescue: every sparse site rescued, in the reused blocks too
    for prompt, tokens in zip(inputs, batched):
        assert tokens == generate(model, [prompt], sc.continuous_batching_config(model, options, **engine))[0]


@pytest.mark.parametrize("selection", ["shared", "refined", "rescue"])
def test_chunked_prefill_and_mixed_steps_keep_each_requests_solo_text(model, selection):
    """Prompts longer than a step's 32 tokens are prefilled in chunks while earlier requests
    already decode: those mixed steps attend sparsely on decode rows and densely on prefill
    rows, so every request still equals its run alone through ``sc.compile``. Here the
    40-token prompt's last token is scheduled alone: a one-row request the mask cannot tell
    from a decode token; it is attended densely, as prefill (``one_token_chunks``). Before
    that, at ``candidates=2.5`` its first token was 48, not 10."""
    inputs = prompts(40, 25, 60)
    options, engine = _selection(selection)
    cb = sc.continuous_batching_config(model, options, **{**engine, "max_batch_tokens": 32})
    batched = generate(model, inputs, cb)
    counts = serving.path_counts(cb)
    assert counts["mixed_steps"] >= 1 and counts["dense_steps"] >= 1 and counts["recency_rows"] == 0, counts
    _check_paths(counts, options)
    assert counts["one_token_chunks"] == 1, counts
    assert batched == _solo(model, inputs, options)


def test_a_forked_request_selects_as_its_parent(model):
    """Parallel sampling (``num_return_sequences=2``): the engine forks each request after its
    prompt and copies the prompt's last, partly written block for the child, outside the step.
    With blocks of 64 tokens (four pages each) the copied block holds whole pages whose
    bounds the child never rewrites: before the state was copied with the block, two of
    three children (top-1 sampling, so as deterministic as greedy) left their parents' text
    at the third or fourth token. Now each child equals its parent, and both equal the
    request run alone through ``sc.compile``."""
    inputs = prompts(40, 25, 60)
    options = {**OPTIONS, "budget": 16, "page_rescue": 32}
    engine = {**ENGINE, "block_size": 64, "num_blocks": 16}
    gen = GenerationConfig(max_new_tokens=NEW, do_sample=True, top_k=1, num_return_sequences=2, eos_token_id=-1,
                           pad_token_id=0)
    cb = sc.continuous_batching_config(model, options, **engine)
    out = model.generate_batch(inputs=inputs, generation_config=gen, continuous_batching_config=cb)
    assert all(o.error is None for o in out.values())
    parents = [out[f"req_{i}"].generated_tokens for i in range(len(inputs))]
    assert [out[f"req_{i}__child#0"].generated_tokens for i in range(len(inputs))] == parents
    assert serving.path_counts(cb)["rescued_sites"] > 0
    assert parents == _solo(model, inputs, options)


def test_copying_a_block_moves_its_state_to_the_copy():
    """``PagedState.copy_blocks``: the destination block gets the source's lagged queries,
    stamps and sampled-row records moved to its own rows, and its pages' bounds; a stamp
    of another block's row is not carried (it names no token of the copy)."""
    stride, unit = 8, 2
    state = paged.PagedState.allocate(1, 4, 2, 3, "cpu")
    state.stride, state.pages_per_block = stride, unit
    state.page_min, state.page_max = torch.randn(1, 4 * unit + 1, 1, 3), torch.randn(1, 4 * unit + 1, 1, 3)
    state.queries[0, 1] = torch.randn(2, 3)
    state.stamps[0, 1] = 1 * stride + 5
    state.stamps[0, 2] = 0 * stride + 3  # a stale stamp: not block 2's row
    state.generated[1], state.generated[2] = 1 * stride + 5, -1
    state.copy_blocks([1, 2], [3, 0])
    assert torch.equal(state.queries[0, 3], state.queries[0, 1])
    assert state.stamps[0, 3] == 3 * stride + 5 and state.stamps[0, 0] == -1
    assert state.generated[3] == 3 * stride + 5 and state.generated[0] == -1
    assert torch.equal(state.page_min[:, 6:8], state.page_min[:, 2:4])
    assert torch.equal(state.page_max[:, 0:2], state.page_max[:, 4:6])


def test_unknown_unbuilt_options_and_our_compile_config_are_refused(model, caplog):
    with pytest.raises(ValueError, match="bugdet"):
        sc.continuous_batching_config(model, {"bugdet": 16})
    with pytest.raises(ValueError, match="fidelity guard.*min_coverage"):
        sc.continuous_batching_config(model, {"budget": 16, "candidates": 2.0, "min_coverage": 0.9})
    with pytest.raises(ValueError, match="varlen_compile_config"):
        sc.continuous_batching_config(model, {"budget": 16}, varlen_compile_config=None)
    with pytest.raises(ValueError, match="max_batch_tokens >= 2"):  # a prompt token could not be told from a decode one
        sc.continuous_batching_config(model, {"budget": 16}, max_batch_tokens=1)



def test_blocks_a_page_does_not_divide_select_without_the_rescue_and_say_so(model, caplog):
    """Blocks of 8 tokens: a 16-token page would straddle two blocks, so the step selects
    without the rescue (never a page mixing two blocks), logs why and how to fix it, and
    counts no rescued site."""
    engine = {**ENGINE, "block_size": 8, "num_blocks": 64}
    cb = sc.continuous_batching_config(model, {**OPTIONS, "budget": 16, "page_rescue": 32}, **engine)
    with caplog.at_level("WARNING", logger="specontext_compile.serving"):
        generate(model, prompts(40, 25), cb)
    assert "without the page rescue" in caplog.text and "page_size to a multiple of 16" in caplog.text
    assert caplog.text.count("without the page rescue") == 1  # once, though two step shapes compile
    counts = serving.path_counts(cb)
    assert counts["sparse_sites"] > 0 and counts["rescued_sites"] == 0 and counts["refined_sites"] == 0, counts


def test_a_graph_without_paged_attention_is_left_as_is_with_its_reason():
    """Negative: SDPA over keys that are graph inputs (no paged gather) is not a paged site."""

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    graph = fx.symbolic_trace(attend).graph
    sites, reason = find_paged_sites(graph)
    assert sites == [] and "no attention over a paged KV cache" in reason


def _mask(lengths: list[int], q_lens: list[int], q_rows: int, kv: int) -> torch.Tensor:
    """Hugging Face's additive block-diagonal causal mask for packed requests."""
    mask = torch.full((1, 1, q_rows, kv), torch.finfo(torch.float32).min)
    row = col = 0
    for total, q in zip(lengths, q_lens):
        for r in range(q):
            mask[0, 0, row + r, col: col + total - q + r + 1] = 0
        row, col = row + q, col + total
    return mask


def test_packed_rows_reads_requests_from_the_mask():
    mask = _mask([5, 3, 4], [1, 2, 1], q_rows=6, kv=12)  # row 5 is padding
    real, last, first, own = paged.packed_rows(paged.packed_visible(mask))
    assert real.tolist() == [True, True, True, True, False, False]
    assert last.tolist() == [True, False, True, True, False, False]
    assert first[:4].tolist() == [0, 5, 5, 8] and own[:4].tolist() == [4, 6, 7, 11]
    assert paged.decode_rows(real, last, first).tolist() == [True, False, False, True, False, False]
    assert paged.step_kind(mask) == paged.MIXED and not paged.is_decode_step(mask)
    assert paged.step_kind(_mask([5, 3, 4], [1, 1, 1], q_rows=4, kv=12)) == paged.SPARSE
    assert paged.step_kind(_mask([5, 3], [2, 3], q_rows=6, kv=8)) == paged.DENSE


def test_a_one_token_prefill_chunk_is_told_from_a_decode_token():
    """Step 1: request A prefills 4 of its 5 prompt tokens (block 0, no token sampled), B
    decodes (block 1, its next token sampled: ``logits_to_keep`` holds its row, then zero
    padding). Step 2: A's last prompt token alone and B's next token are both one-row
    requests; only B decodes (its previous row sampled this token), A still prefills."""
    stride = 16
    assert paged.sampled_rows(torch.tensor([4, 0, 0]), 5).tolist() == [False] * 4 + [True]
    assert paged.sampled_rows(torch.tensor([0, 2, 0]), 3).tolist() == [True, False, True]
    assert paged.sampled_rows(torch.tensor([0, 0]), 2).tolist() == [True, False]  # entry 0 always counts
    generated = torch.full((4,), -1)
    step1 = _mask([4, 3], [4, 1], q_rows=5, kv=7)
    paged.record_generated(generated, step1, torch.tensor([0, 1, 2, 3, 18]), torch.tensor([4, 0]), stride)
    assert generated.tolist() == [-1, 18, -1, -1]
    step2 = _mask([5, 4], [1, 1], q_rows=2, kv=9)
    read = torch.tensor([0, 1, 2, 3, 4, 16, 17, 18, 19])
    decode, chunk = paged.decoding_rows(step2, read, generated, stride)
    assert decode.tolist() == [False, True] and chunk.tolist() == [True, False]
    assert paged.classify_step(step2, decode) == (paged.MIXED, 1)
    assert paged.classify_step(step2) == (paged.SPARSE, 2)  # the mask alone: both look like decode tokens
    blind, none = paged.decoding_rows(step2, read, None, stride)  # no logits_to_keep: the mask's reading
    assert blind.tolist() == [True, True] and not none.any()
    index, _, _, subset = paged.decode_subset(step2, 2, chunk)
    assert subset.tolist() == [False, True] and index.tolist()[0] == 1


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(2, 12), st.booleans()), min_size=1, max_size=5), st.integers(0, 3),
       st.integers(0, 2 ** 16))
def test_a_mixed_steps_decode_rows_select_as_in_the_whole_step(requests, spare, seed):
    """Property: the selection over :func:`paged.decode_subset`'s rows (the decode rows, at a
    bound of exactly the decode count or more) gives each decode row the columns the
    selection over every row gives it; the subset's output expands back to those rows."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [n for n, _ in requests]
    q_lens = [1 if decoding else n // 2 + 1 for n, decoding in requests]
    q_rows, kv = sum(q_lens) + 2, sum(lengths)  # two padding rows
    mask = _mask(lengths, q_lens, q_rows, kv)
    heads, kv_heads, d, blocks, stride = 4, 2, 8, 16, 4  # 64 cache rows >= 5 x 12 columns
    queries = torch.randn(1, blocks, heads, d, generator=gen)
    read_index = torch.randperm(blocks * stride, generator=gen)[:kv]
    stamps = read_index[torch.randint(0, kv, (1, blocks), generator=gen)]  # some rows find their query
    key_view = torch.randn(blocks * stride, kv_heads, d, generator=gen)
    spec = StepSpec(3, 3, sink_tokens=1, recent_window=1)
    whole = paged.packed_select(queries, stamps, [key_view], read_index, mask, spec, 0.3, stride)
    decoding = int(whole[3].sum())
    bound = max(decoding, 1) + spare
    index, sub_mask, slot, decode = paged.decode_subset(mask, bound)
    assert torch.equal(decode, whole[3]) and index[:decoding].tolist() == decode.nonzero().view(-1).tolist()
    part = paged.packed_select(queries, stamps, [key_view], read_index, sub_mask, spec, 0.3, stride)
    assert torch.equal(part[0][:decoding], whole[0][decode])
    assert int(part[1]) == int(whole[1])  # the recency count: the same rows, padding entries count nothing
    rows = torch.arange(bound, dtype=torch.float32).view(1, 1, bound, 1)
    back = paged.expand_decode_rows(rows, slot)[0, 0, :, 0]
    assert back[decode].tolist() == list(range(decoding))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=4), st.integers(0, 2 ** 16))
def test_sparse_attention_over_every_visible_column_equals_float64_attention(lengths, seed):
    """Property: with every visible column selected, each decode row's packed sparse attention
    is its request's dense attention (float64 reference), through ``read_index``."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, d, rows_total = 4, 2, 8, 64
    kv = sum(lengths)
    q_rows = len(lengths)
    key_view = torch.randn(rows_total, kv_heads, d, generator=gen)
    value_view = torch.randn(rows_total, kv_heads, d, generator=gen)
    read_index = torch.randperm(rows_total, generator=gen)[:kv]
    query = torch.randn(1, heads, q_rows, d, generator=gen)
    visible = paged.packed_visible(_mask(lengths, [1] * q_rows, q_rows, kv))
    cols = torch.arange(kv)
    columns = torch.where(visible, cols, -1).expand(q_rows, kv_heads, kv)
    out = paged.packed_sparse_attention(query, key_view, value_view, read_index, columns, 0.3)
    start = 0
    for r, n in enumerate(lengths):
        rows = read_index[start: start + n]
        k = key_view[rows].double().repeat_interleave(2, dim=1).transpose(0, 1)  # [H, n, d]
        v = value_view[rows].double().repeat_interleave(2, dim=1).transpose(0, 1)
        probs = torch.softmax(query[0, :, r:r + 1].double() @ k.transpose(-1, -2) * 0.3, -1)
        torch.testing.assert_close(out[0, :, r:r + 1].double(), probs @ v, atol=1e-5, rtol=0)
        start += n


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 14), min_size=1, max_size=4), st.integers(1, 8), st.integers(0, 3),
       st.integers(0, 4), st.integers(0, 2 ** 16))
def test_refined_attention_keeps_each_layers_own_budget_as_float64_ranking_does(lengths, budget, sinks, recent,
                                                                              seed):
    """Property: with every visible column a candidate, each row keeps its first ``sinks``
    and last ``max(recent, 1)`` tokens (inside the budget) and the rest of ``budget`` by the
    float64 softmax of this layer's query, max over the KV group's query heads, and
    attends to exactly those (float64 attention reference; random logits: ties
    improbable)."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, d, rows_total, scale = 4, 2, 8, 64, 0.3
    kv, q_rows = sum(lengths), len(lengths)
    key_view = torch.randn(rows_total, kv_heads, d, generator=gen) * 2
    value_view = torch.randn(rows_total, kv_heads, d, generator=gen)
    read_index = torch.randperm(rows_total, generator=gen)[:kv]
    query = torch.randn(1, heads, q_rows, d, generator=gen)
    visible = paged.packed_visible(_mask(lengths, [1] * q_rows, q_rows, kv))
    columns = torch.where(visible, torch.arange(kv), -1).expand(q_rows, kv_heads, kv)
    spec = StepSpec(budget, max(kv, budget), sink_tokens=sinks, recent_window=recent)
    out = paged.packed_refine_attention(query, key_view, value_view, read_index, columns, scale, spec)
    start = 0
    for r, n in enumerate(lengths):
        rows = read_index[start: start + n]
        for h in range(kv_heads):
            k, v = key_view[rows, h].double(), value_view[rows, h].double()  # [n, d]
            q = query[0, 2 * h: 2 * h + 2, r].double()  # the group's two query heads [2, d]
            probs = torch.softmax(q @ k.T * scale, -1)
            keep = min(budget, n)
            last = min(max(recent, 1), keep)
            first = min(sinks, keep - last)
            forced = [j for j in range(n) if j < first or j >= n - last]
            rest = sorted((j for j in range(n) if j not in forced), key=lambda j: -float(probs[:, j].max()))
            kept = (forced + rest)[:keep]
            want = torch.softmax(q @ k[kept].T * scale, -1) @ v[kept]
            torch.testing.assert_close(out[0, 2 * h: 2 * h + 2, r].double(), want, atol=1e-5, rtol=0)
        start += n


@pytest.mark.slow
@pytest.mark.parametrize("page_rescue", [0, 32])
def test_the_compiled_step_gives_the_eager_steps_tokens(model, page_rescue):
    """Inductor compiles both variants (``inner="inductor"``): the same tokens as the eager
    step (``"auto"``), the same counters (with the page rescue: its bounds, a view of a graph
    input per layer, updated in place inside the compiled step)."""
    inputs = prompts(40, 25, 60)
    runs = {}
    for inner in ("auto", "inductor"):
        torch._dynamo.reset()
        options = {"budget": 16, **OPTIONS, "inner": inner, "page_rescue": page_rescue}
        cb = sc.continuous_batching_config(model, options, **ENGINE)
        runs[inner] = generate(model, inputs, cb), serving.path_counts(cb)
    assert runs["inductor"] == runs["auto"]
    assert runs["inductor"][1]["sparse_steps"] == NEW - 1


def test_a_sliding_window_model_is_refused_with_the_fix():
    """Hugging Face caches sliding-window layers in a ring buffer (packed columns not in
    position order): refused up front, not decoded wrongly."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, sliding_window=16)
    with pytest.raises(ValueError, match="sliding_attention.*ContinuousBatchingConfig"):
        sc.continuous_batching_config(MistralForCausalLM(cfg), {"budget": 16, **OPTIONS}, **ENGINE)


def test_the_recompile_limit_counts_every_padded_query_and_kv_size():
    """A graph per (padded query size, padded KV size): with the KV padded to a quarter of the
    cache, four KV sizes per query size (one counted before: past the limit torch ran steps
    without the backend)."""
    from specontext_compile.serving import _recompile_limit

    engine = {"q_padding_interval_size": 8, "max_batch_tokens": 512, "num_blocks": 16, "page_size": 32}
    assert _recompile_limit(engine) == 64 + 2
    assert _recompile_limit({**engine, "kv_padding_interval_size": 512}) == 64 + 2  # the whole cache: one size
    assert _recompile_limit({**engine, "kv_padding_interval_size": 128}) == 64 * 4 + 2
    assert _recompile_limit({**engine, "kv_padding_interval_size": 100}) == 64 * 6 + 2  # 512 / 100, rounded up
    assert _recompile_limit({"max_batch_tokens": 512}) is None


def test_a_plain_engine_config_with_the_backend_runs_dense_and_its_warning_names_the_fix(model, caplog, monkeypatch):
    """Hugging Face's own ContinuousBatchingConfig with varlen_compile_config naming the backend: its
    paged cache's update breaks the graph, so every step runs dense (exact: the same tokens as
    the engine without the backend), and the one WARNING names sc.continuous_batching_config,
    not Hugging Face's DynamicCache or a static cache, which a paged engine cannot take."""
    import logging

    from transformers import ContinuousBatchingConfig
    from transformers.generation.configuration_utils import CompileConfig

    import specontext_compile.backend as backend

    monkeypatch.setattr(backend, "_DENSE_CACHE_WARNED", False)
    compile_config = CompileConfig(backend="specontext", mode=None, options={"budget": 16})
    compile_config._compile_all_devices = True  # CPU: without it Hugging Face does not compile
    inputs = prompts(40)
    with caplog.at_level(logging.WARNING, logger="specontext_compile.backend"):
        tokens = generate(model, inputs, ContinuousBatchingConfig(varlen_compile_config=compile_config, **ENGINE))
    dense = generate(model, inputs, ContinuousBatchingConfig(**ENGINE))
    assert tokens == dense
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "specontext:" in r.getMessage()]
    assert any("specontext_compile.continuous_batching_config" in w for w in warnings), warnings
    assert not any("DynamicCache" in w for w in warnings), warnings
