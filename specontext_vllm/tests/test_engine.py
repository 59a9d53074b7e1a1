"""vLLM engines with the plugin on a tiny random Llama (4 layers, 4 query / 2 KV heads,
head_dim 64, fp32, eager, block 32; three requests of 300, 170 and 90 prompt tokens, 24 greedy
tokens each; retrieval layers 1 and 2).

* Budget covering every request: the decode rows run the plugin's path (its counters: every
  decode row of every layer served from a selection, none ranked by recency, prefill tokens on
  vLLM's kernel) and the tokens equal Hugging Face's greedy ones.
* Budget 48: the same path serves a sparse step (counters), and the options reach it.
* The refinement (``page_rescue``, ``candidates > 1``): over every token it is dense text; it
  runs on the layers the options name (counters).
* bfloat16 at full budget: the tokens equal vLLM's own dense run's.
* Prefix caching: a request reusing a cached prefix decodes as it does alone.
* ``dense_layers`` and ``dense_below``: those layers, and requests that short, decode on
  vLLM's kernel over every block (exact), the rest of the batch stays sparse.
* ``min_coverage`` (the fidelity guard): rows whose refinement drops too much of the
  candidates' mass attend to every block on that layer.
* Preemption: requests preempted for want of KV blocks and recomputed decode as they do
  with room to spare (with the refinement too, slow tier).
"""

import gc

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

from specontext_vllm.options import plugin_options

LAYERS, NEW = 4, 24  # LAYERS: the conftest's tiny Llama (fixture `folder`)
PROMPTS = (300, 170, 90)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPTS]


def _generate(folder, prompts, options, prefix_caching=False, one_by_one=False, dtype="float32",
              kv_bytes=256 * 2**20, max_model_len=1024, ignore_eos=False, inspect=None):
    """Greedy tokens of each prompt (all at once, or one ``generate`` call after the other) and
    the plugin's counters; ``inspect(llm)`` runs on the engine before it is closed."""
    from vllm import LLM, SamplingParams

    counters["specontext_vllm"].clear()
    llm = LLM(model=folder, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, max_model_len=max_model_len,
              block_size=32, max_num_seqs=4, kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=prefix_caching,
              additional_config={"specontext": options} if options is not None else {})
    params = SamplingParams(max_tokens=NEW, temperature=0.0, detokenize=False, ignore_eos=ignore_eos)
    try:
        batches = [[p] for p in prompts] if one_by_one else [prompts]
        outs = [o for batch in batches for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)]
        if inspect is not None:
            inspect(llm)
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


@pytest.mark.parametrize("keys", ["int8", "store"])
def test_the_int8_selection_scores_copies_of_every_key_written(folder, prompts, keys):
    """Option ``selection_keys`` (default ``"int8"``): every step's selection scores the
    retrieval layers' int8 keys (counted), and their copies hold ``quantize_rows`` of exactly
    the keys vLLM's cache holds, at every slot written (prompts and decode steps); the other
    layers keep none. ``"store"`` scores vLLM's cache and keeps no copy."""
    from specontext_compile.runtime.int8_keys import quantize_rows
    from specontext_vllm.layout import probe_layout

    seen = {}

    def inspect(llm):
        context = llm.llm_engine.vllm_config.compilation_config.static_forward_context
        for name, layer in context.items():
            copy = layer.impl.int8_keys
            seen[name] = None if copy is None else (copy.levels[:-1].clone(), copy.scales[:-1].clone(),
                                                    layer.kv_cache.clone(), layer.isa)

    options = {"budget": 48, "sink_tokens": 2, "recent_window": 8, "retrieval_layers": [1, 2]}
    if keys == "store":
        options["selection_keys"] = "store"
    _, stats = _generate(folder, prompts, options, inspect=inspect)
    assert stats["selection_steps"] >= NEW - 1
    if keys == "store":
        assert stats.get("int8_selection_steps", 0) == 0 and all(v is None for v in seen.values())
        return
    assert stats["int8_selection_steps"] == stats["selection_steps"]
    assert [n for n, v in seen.items() if v is not None] == [f"model.layers.{i}.self_attn.attn" for i in (1, 2)]
    for levels, scales, kv_cache, isa in (v for v in seen.values() if v is not None):
        blocks, num_kv, bs, d = levels.shape
        written = scales[:, 0] != 0  # [blocks, bs]
        assert int(written.sum()) == sum(PROMPTS) + len(PROMPTS) * (NEW - 1)  # the last token's KV is never written
        slots = written.flatten().nonzero().flatten()
        layout = probe_layout(isa, kv_cache.dtype, bs, d)
        table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
        stored, _ = layout.gather(kv_cache, table, slots.view(1, 1, -1).expand(1, num_kv, -1), with_values=False)
        want_levels, want_scales = quantize_rows(stored[0].transpose(0, 1))  # [slots, kv, d]
        assert torch.equal(levels.transpose(1, 2).reshape(-1, num_kv, d)[slots], want_levels)
        assert torch.equal(scales.transpose(1, 2).reshape(-1, num_kv)[slots], want_scales)


@pytest.mark.parametrize("extra", [{}, pytest.param({"page_rescue": 64, "candidates": 2}, marks=pytest.mark.slow)],
                         ids=["shared", "refined"])
def test_a_request_reusing_a_cached_prefix_decodes_as_alone(folder, prompts, extra):
    """Prefix caching on: a second request sharing the first one's 256-token prefix reuses its
    KV blocks (and the queries and bounds recorded there); at budget 48 its tokens equal the
    same request served alone without prefix caching (its selection reads only its own previous
    token's record); with the refinement too (slow tier)."""
    options = {"budget": 48, "sink_tokens": 2, "recent_window": 8, "retrieval_layers": [1, 2], **extra}
    first = prompts[0]
    second = first[:256] + prompts[1][:60]
    shared, stats = _generate(folder, [first, second], options, prefix_caching=True, one_by_one=True)
    alone, _ = _generate(folder, [second], options)
    assert shared[1] == alone[0]
    assert stats["recency_rows"] == 0 and stats["sparse_decode_rows"] == 2 * (NEW - 1) * LAYERS
    assert stats.get("refined_rows", 0) == (2 * (NEW - 1) * LAYERS if extra else 0)
    # the second prompt's prefill ran only past the cached prefix (vLLM's kernel)
    assert stats["dense_prefill_tokens"] < (len(first) + len(second)) * LAYERS


def test_a_refinement_over_every_token_is_dense_text_on_the_refine_path(folder, prompts):
    """Budget 4096 with ``page_rescue``: every layer refines (:mod:`specontext_vllm.refine`),
    its candidates every token of the request (the shared selection keeps all blocks, the
    rescue finds none left), so it keeps them all and the tokens equal Hugging Face's greedy
    ones; the counters show every decode row of every layer took the refinement."""
    options = {"budget": 4096, "retrieval_layers": [1, 2], "page_rescue": 64}
    tokens, stats = _generate(folder, prompts, options)
    assert tokens == _hugging_face(folder, prompts)
    rows = len(prompts) * (NEW - 1) * LAYERS
    assert stats["sparse_decode_rows"] == rows and stats["refined_rows"] == rows and stats["rescue_rows"] == rows
    assert stats["recency_rows"] == 0


def test_two_stage_selection_refines_on_every_layer(folder, prompts):
    """``candidates=2`` at budget 48: the shared selection keeps 96 tokens in blocks and every
    layer refines them to 48 (counters), no layer rescues."""
    options = {"budget": 48, "sink_tokens": 2, "recent_window": 8, "retrieval_layers": [1, 2], "candidates": 2}
    tokens, stats = _generate(folder, prompts, options)
    assert [len(t) for t in tokens] == [NEW] * len(prompts)
    rows = len(prompts) * (NEW - 1) * LAYERS
    assert stats["refined_rows"] == rows and stats.get("rescue_rows", 0) == 0 and stats["recency_rows"] == 0
    assert stats.get("guard_dense_rows", 0) == 0  # the guard is off by default


def test_the_rescue_runs_on_its_layers_only(folder, prompts):
    options = {"budget": 48, "sink_tokens": 2, "recent_window": 8, "retrieval_layers": [1, 2], "page_rescue": 64,
               "rescue_layers": [0, -1]}
    tokens, stats = _generate(folder, prompts, options)
    assert [len(t) for t in tokens] == [NEW] * len(prompts)
    assert stats["rescue_rows"] == len(prompts) * (NEW - 1) * 2  # layers 0 and 3 of 4
    assert stats["refined_rows"] == stats["rescue_rows"]  # only the rescuing layers refine at candidates=1


def test_dense_layers_keep_vllms_kernel_and_the_others_stay_sparse(folder, prompts):
    """``dense_layers=[0, -1]`` with the refinement on: layers 0 and 3 serve every decode row
    with vLLM's kernel (``dense_decode_rows``), layers 1 and 2 stay sparse and refine (and
    rescue); none of the dense layers refines or rescues."""
    options = {"budget": 48, "sink_tokens": 2, "recent_window": 8, "retrieval_layers": [1, 2], "candidates": 2,
               "page_rescue": 64, "dense_layers": [0, -1]}
    tokens, stats = _generate(folder, prompts, options)
    assert [len(t) for t in tokens] == [NEW] * len(prompts)
    rows = len(prompts) * (NEW - 1)
    assert stats["dense_decode_rows"] == rows * 2 and stats["sparse_decode_rows"] == rows * 2
    assert stats["refined_rows"] == rows * 2 and stats["rescue_rows"] == rows * 2


def test_requests_at_most_dense_below_tokens_decode_exactly(folder, prompts):
    """``dense_below=200`` at budget 48 with ``candidates=2`` (every layer refines): the
    requests of 170 and 90 prompt tokens (at most 193 with their 24 new ones) attend to every
    block on every layer, so their tokens equal Hugging Face's greedy ones; the 300-token
    request stays sparse and refined in the same batch (counters per row and layer)."""
    options = {"budget": 48, "sink_tokens": 2, "recent_window": 8, "retrieval_layers": [1, 2], "candidates": 2,
               "dense_below": 200}
    tokens, stats = _generate(folder, prompts, options)
    want = _hugging_face(folder, prompts[1:])
    assert tokens[1:] == want
    assert stats["dense_decode_rows"] == 2 * (NEW - 1) * LAYERS
    assert stats["sparse_decode_rows"] == stats["refined_rows"] == (NEW - 1) * LAYERS


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"dense_below": 4096}, {"dense_layers": [0, 1, 2, 3], "page_rescue": 64}],
                         ids=["dense_below", "dense_layers"])
def test_every_row_or_layer_dense_is_hugging_faces_text(folder, prompts, options):
    """Every request at most ``dense_below`` (no scores made: the selection is every block),
    or every layer in ``dense_layers``, at budget 48: Hugging Face's greedy tokens."""
    options = {"budget": 48, "sink_tokens": 2, "recent_window": 8, "retrieval_layers": [1, 2], **options}
    tokens, stats = _generate(folder, prompts, options)
    assert tokens == _hugging_face(folder, prompts)
    assert stats["dense_decode_rows"] == len(prompts) * (NEW - 1) * LAYERS and stats.get("sparse_decode_rows", 0) == 0


def test_the_fidelity_guard_sends_rows_that_drop_mass_dense(folder, prompts):
    """``min_coverage`` near 1 with every token a candidate (``candidates=inf``) at budget 48:
    a row that drops any of its candidates' softmax mass (every row longer than 48 tokens) is
    sent to vLLM's kernel over every block on that layer (``guard_dense_rows``), so the text is
    Hugging Face's (with the guard off, the refinement tests above count no guarded row)."""
    options = {"budget": 48, "sink_tokens": 2, "recent_window": 8, "retrieval_layers": [1, 2],
               "candidates": float("inf"), "min_coverage": 0.999999}
    tokens, stats = _generate(folder, prompts, options)
    assert tokens == _hugging_face(folder, prompts)
    rows = len(prompts) * (NEW - 1) * LAYERS
    assert stats["guard_dense_rows"] == rows and stats["refined_rows"] == rows


# a block of the tiny Llama: 4 layers x (key, value) x 2 KV heads x 32 tokens x 64 x fp32
BLOCK_BYTES = LAYERS * 2 * 2 * 32 * 64 * 4


@pytest.mark.parametrize("budget, extra", [(48, {}), (4096, {}),
                                           pytest.param(48, {"page_rescue": 64, "candidates": 2}, marks=pytest.mark.slow)],
                         ids=["48", "4096", "48-refined"])
def test_preempted_requests_decode_as_with_room_to_spare(folder, prompts, monkeypatch, budget, extra):
    """16 KV blocks for three requests of 150, 140 and 130 prompt tokens (5 blocks each at
    admission, 17 once they have grown by 24 tokens): vLLM preempts a running request (its blocks
    freed, recomputed later by a prefill of its prompt and generated tokens). Its records went
    with its blocks (their stamps no longer match); the recomputing prefill records its last
    query rows again, so its next decode step selects from its own previous query, never a
    stale one and never by recency (``recency_rows == 0``).

    The token the recomputing prefill samples is vLLM's prefill, dense: at budget 4096 every
    token equals the run with room for all; at budget 48 the preempted request's tokens equal
    up to its preemption (it may part there: dense where the roomy run decoded sparse) and the
    other requests' tokens all equal. With the refinement (``page_rescue`` and ``candidates=2``,
    slow tier) the same holds and every decode row refines (its counter)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    preempted = {}  # request index -> tokens generated when preempted
    original = Scheduler._preempt_request

    def spy(self, request, *args, **kwargs):
        preempted.setdefault(int(request.request_id.split("-")[0]), len(request.output_token_ids))
        return original(self, request, *args, **kwargs)

    options = {"budget": budget, "sink_tokens": 2, "recent_window": 8, "retrieval_layers": [1, 2], **extra}
    prompts = [p[:n] for p, n in zip(prompts, (150, 140, 130))]
    roomy, _ = _generate(folder, prompts, options, max_model_len=352, ignore_eos=True)
    monkeypatch.setattr(Scheduler, "_preempt_request", spy)
    tight, stats = _generate(folder, prompts, options, kv_bytes=16 * BLOCK_BYTES, max_model_len=352, ignore_eos=True)
    assert preempted, "no request was preempted: the test no longer exercises preemption"
    for i, (a, b) in enumerate(zip(tight, roomy)):
        assert a[:preempted.get(i, NEW)] == b[:preempted.get(i, NEW)], i
    if budget == 4096:
        assert tight == roomy
    assert stats["recency_rows"] == 0
    # each preemption turns one decode step of the request into the recomputing prefill's token
    assert stats["sparse_decode_rows"] == (len(prompts) * (NEW - 1) - len(preempted)) * LAYERS
    assert stats.get("refined_rows", 0) == (stats["sparse_decode_rows"] if extra else 0)


class _Config:
    def __init__(self, extra):
        self.additional_config = extra


def test_options_are_the_backends_and_unbuilt_ones_are_refused():
    assert plugin_options(_Config({})) is None
    assert plugin_options(_Config({"specontext": {"budget": 64}})).budget == 64
    with pytest.raises(ValueError, match="'budget' must be an int >= 1"):
        plugin_options(_Config({"specontext": {"budget": 0}}))
    with pytest.raises(ValueError, match=r"device_memory_bytes=1000000000 is not built in the vLLM plugin yet"):
        plugin_options(_Config({"specontext": {"device_memory_bytes": 10**9}}))
    with pytest.raises(ValueError, match="'min_coverage' needs a refinement"):  # the plugin's page_rescue is 0
        plugin_options(_Config({"specontext": {"min_coverage": 0.5}}))
    assert plugin_options(_Config({"specontext": {"min_coverage": 0.5, "candidates": 2}})).min_coverage == 0.5
    with pytest.raises(ValueError, match="'dense_below' must be an int >= 0"):
        plugin_options(_Config({"specontext": {"dense_below": -1}}))
    dense = plugin_options(_Config({"specontext": {"budget": 64, "page_rescue": 128, "dense_layers": [0, -1],
                                                   "dense_below": 100}}))
    assert dense.dense(0, 30) and dense.dense(29, 30) and not dense.dense(1, 30)
    assert not dense.rescues(0, 30) and not dense.refines(29, 30) and dense.rescues(1, 30)
    assert dense.dense_rows(torch.tensor([100, 101])).tolist() == [True, False]
    # vLLM's lengths are int32: a dense_below past their range still covers every request
    huge = plugin_options(_Config({"specontext": {"dense_below": 2**31, "budget": 64}}))
    assert huge.dense_rows(torch.tensor([300, 5], dtype=torch.int32)).tolist() == [True, True]
    assert plugin_options(_Config({"specontext": {"dense_below": 10**30}})).dense_rows(
        torch.tensor([7], dtype=torch.int32)).tolist() == [True]
    # a layer the model lacks names nothing (the backend's rule), logged, never the nearest layer
    far = plugin_options(_Config({"specontext": {"dense_layers": [10, -5], "page_rescue": 64, "rescue_layers": [7]}}))
    assert not any(far.dense(j, 4) for j in range(4)) and not any(far.rescues(j, 4) for j in range(4))
    assert plugin_options(_Config({"specontext": {"dense_layers": [0, 1, 2, -1]}})).every_layer_dense(4)
    with pytest.raises(ValueError, match="rescue_layers=\\[\\] leaves no layer refining"):
        plugin_options(_Config({"specontext": {"min_coverage": 0.5, "page_rescue": 64, "rescue_layers": []}}))
    assert plugin_options(_Config({"specontext": {"budget": 64}})).dense_rows(torch.tensor([5])) is None
    # the selection's keys: the backend's default (int8) and names, the backend's error otherwise
    assert plugin_options(_Config({"specontext": {"budget": 64}})).int8_selection
    assert not plugin_options(_Config({"specontext": {"selection_keys": "store"}})).int8_selection
    with pytest.raises(ValueError, match="'selection_keys' must be one of"):
        plugin_options(_Config({"specontext": {"selection_keys": "fp8"}}))
    two_stage = plugin_options(_Config({"specontext": {"budget": 64, "candidates": 2.5}}))
    assert two_stage.selected_tokens() == 160 and two_stage.refines(0, 30)
    assert plugin_options(_Config({"specontext": {"candidates": float("inf")}})).selected_tokens() is None
    # a finite candidates whose product with the budget overflows: every token, as inf
    assert plugin_options(_Config({"specontext": {"candidates": 1e308, "budget": 1024}})).selected_tokens() is None
    rescue = plugin_options(_Config({"specontext": {"budget": 64, "page_rescue": 128, "rescue_layers": [-1]}}))
    assert rescue.page_rescue == 128 and rescue.rescues(29, 30) and not rescue.rescues(28, 30)
    assert plugin_options(_Config({"specontext": {"budget": 64}})).page_rescue == 0  # the plugin's default
    with pytest.raises(TypeError, match="must be a dict"):
        plugin_options(_Config({"specontext": 1024}))
