"""Never silently dense, never silently wrong (issue 25).

One test per class of the field cases in ``shared/cases`` (own inputs, tiny models):
per-request state kept with its own cache (two Hugging Face ``StaticCache`` conversations on
one model), multi-token steps exact (chunked prefill), recompiles that do not lose sparsity
(a budget sweep, dynamo's recompile limit, a second model of another size), a budget above a
symbolic store, the counters of the one-call path, and the messages (output_attentions,
backward). References: eager dense attention, or the same conversation run alone.
"""

import logging

import pytest
import torch
from _tiny import tiny_llama
from specontext_compile.passes.sites import static_int
from specontext_compile.runtime import aten_step
from test_backend_e2e import decode_logits
from torch._dynamo.utils import counters
from transformers import StaticCache

import specontext_compile as sc
from specontext_compile.backend import BACKWARD_SUPPORT, _checked_backward, compile_reports
from specontext_compile.runtime.spec import AttentionVariant, StepSpec

SMALL = {"budget": 12, "sink_tokens": 2, "recent_window": 3}
ATOL = 1e-4  # fp32 compiled step vs eager SDPA: ~1e-7 observed


def _ids(length, seed, batch=1):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


class _Conversation:
    """Prefill then greedy decode, one call per :meth:`step` (two can interleave)."""

    def __init__(self, forward, cache, ids):
        self.forward, self.cache = forward, cache
        with torch.no_grad():
            self.token = forward(input_ids=ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        self.logits = []

    def step(self):
        with torch.no_grad():
            out = self.forward(input_ids=self.token, cache=self.cache, use_cache=True).logits[:, -1]
        self.logits.append(out)
        self.token = out.argmax(-1, keepdim=True)


def test_two_static_cache_conversations_do_not_share_retrieval_state():
    """Case static_cache_two_conversations: conversation A interleaved with B (equal and
    different prompt lengths) gives exactly A's solo logits; each cache counts its own steps."""
    model = tiny_llama(layers=2)
    forward = torch.compile(model.forward, backend="specontext", options=SMALL)  # the default step
    a_ids = _ids(40, seed=1)
    alone = _Conversation(forward, StaticCache(config=model.config, max_cache_len=56), a_ids)
    for _ in range(4):
        alone.step()
    for b_ids in (_ids(40, seed=2), _ids(33, seed=3)):
        a = _Conversation(forward, StaticCache(config=model.config, max_cache_len=56), a_ids)
        b = _Conversation(forward, StaticCache(config=model.config, max_cache_len=56), b_ids)
        for _ in range(4):
            a.step()
            b.step()
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(alone.logits), atol=0, rtol=0)
        for conv in (a, b):
            counts = sc.path_counts(conv.cache)
            assert counts["decode_steps"] == 4 and counts["gather_sites"] == 8, counts
    dense = _Conversation(model.forward, StaticCache(config=model.config, max_cache_len=56), a_ids)
    for _ in range(4):
        dense.step()
    assert (torch.stack(alone.logits) - torch.stack(dense.logits)).abs().max() > 1e-3  # the selection mattered
    assert sc.path_counts(model)["decode_steps"] == 4 * 5  # the model counts every cache's steps


@pytest.mark.parametrize("inner", ["eager", pytest.param("auto", marks=pytest.mark.slow)])
def test_chunked_prefill_is_dense_and_exact(inner):
    """Case chunked_prefill_stays_dense: generate(prefill_chunk_size=8) at budget 12 of a
    40-token prompt gives eager dense generate's first-token logits; the 8-token graph says
    why it stayed dense. Decode steps after it are still sparse."""
    model = tiny_llama(layers=2)
    model.generation_config.eos_token_id = None
    ids = _ids(40, seed=4)
    kw = {"max_new_tokens": 3, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    want = model.generate(ids, **kw).logits[0]
    sc.compile(model, **SMALL, inner=inner)
    got = model.generate(ids, prefill_chunk_size=8, **kw).logits[0]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    reasons = {s.reason for r in compile_reports() for s in r.result.sites if s.q_len == 8}
    assert reasons and all(r.startswith("prefill (8 query tokens") for r in reasons), reasons
    assert sc.path_counts(model)["gather_sites"] == 2 * 2  # two one-token decode steps, 2 layers


def test_max_sparse_q_len_declares_multi_token_steps_sparse():
    """The documented opt-in: max_sparse_q_len=8 makes an 8-token step after a prompt a
    (sparse) decode step, counted; the default keeps it dense (previous test)."""
    model = tiny_llama(layers=2)
    forward = torch.compile(model.forward, backend="specontext",
                            options={**SMALL, "inner": "eager", "max_sparse_q_len": 8},
                            dynamic=False)  # else the 8-token graph has a symbolic query length: dense
    cache = sc.SpeContextCache(model.config, max_cache_len=64)
    with torch.no_grad():
        forward(input_ids=_ids(40, seed=5), cache=cache, use_cache=True)
        forward(input_ids=_ids(8, seed=6), cache=cache, use_cache=True)
    assert cache.path_counts()["gather_sites"] == 2


@pytest.mark.slow  # fast tier on the 2-core Xeon (docs/testing.md)
def test_budget_sweep_in_one_process_keeps_every_budget_sparse():
    """Case budget_sweep_one_process: sc.compile at six budgets on one model (12 graphs on
    one code object, past dynamo's recompile_limit of 8): every budget's decode steps run
    through its own rewritten graph and select exactly ``budget`` positions."""
    model = tiny_llama(layers=2)
    ids = _ids(40, seed=7)
    for budget in (8, 10, 12, 14, 16, 18):
        sc.compile(model, budget=budget, sink_tokens=2, recent_window=3, inner="eager")
        cache = sc.SpeContextCache(model.config, max_cache_len=48)
        model.generate(ids, max_new_tokens=4, do_sample=False, cache=cache)
        assert cache.path_counts()["decode_steps"] == 3, (budget, cache.path_counts())
        assert cache.path_counts()["gather_sites"] == 3 * 2  # this cache's steps: this budget's graph
        assert compile_reports()[-1].config.budget == budget  # the new option took effect
    assert counters["specontext"]["recompile_limit_frames"] == 0


def test_recompile_limit_on_a_compiled_frame_warns_naming_the_fix(caplog):
    """Dynamo's recompile limit reached on a frame the backend compiled: the decode step runs
    uncompiled (dense), and the backend says so once, naming the fix, and counts it."""
    model = tiny_llama(layers=2)
    forward = torch.compile(model.forward, backend="specontext", options={**SMALL, "inner": "eager"},
                            recompile_limit=1)  # the prefill graph fills it; the decode step cannot compile
    cache = sc.SpeContextCache(model.config, max_cache_len=48)
    with caplog.at_level(logging.WARNING, logger="specontext_compile"):
        decode_logits(None, forward, _ids(40, seed=8), 3, cache)
    assert cache.path_counts()["decode_steps"] == 0  # what the warning is about
    ours = [r.getMessage() for r in caplog.records if r.name == "specontext_compile.fallbacks"]
    assert len(ours) == 1 and "recompile_limit (1)" in ours[0] and "specontext_compile.compile" in ours[0], ours
    assert counters["specontext"]["recompile_limit_frames"] == 1


def test_second_model_of_another_size_is_still_sparse():
    """Case two_models_one_process: after a hidden-96 model, a hidden-128 one compiled in the
    same process (dynamo made its sizes and scale symbolic, then guarded them equal to
    constants) still rewrites its decode sites, and decodes exactly at full budget."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def _llama(hidden_size):
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=hidden_size, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            attn_implementation="sdpa")).eval()

    first = _llama(hidden_size=64)  # head_dim 16
    decode_logits(None, torch.compile(first.forward, backend="specontext", options={"inner": "eager"}),
                  _ids(20, seed=9), 1, sc.SpeContextCache(first.config, max_cache_len=32))
    second = _llama(hidden_size=128)  # head_dim 32: another scale, other store widths
    options = {"budget": 64, "dense_shortcut": False, "inner": "eager"}
    cache = sc.SpeContextCache(second.config, max_cache_len=32)
    got = decode_logits(None, torch.compile(second.forward, backend="specontext", options=options),
                        _ids(20, seed=10), 3, cache)
    want = decode_logits(None, second.forward, _ids(20, seed=10), 3, sc.SpeContextCache(second.config, max_cache_len=32))
    torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=ATOL, rtol=0)
    assert cache.path_counts()["gather_sites"] == 3 * 2, cache.path_counts()


def test_a_symbol_pinned_by_a_guard_is_a_constant():
    """static_int reads a SymInt as an int only when dynamo's guards pinned it (a replacement
    in the shape environment); a free symbol stays None (the site then stays dense)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    pinned, free = env.create_unbacked_symint(), env.create_unbacked_symint()
    torch._check(pinned == 32)
    assert static_int(pinned) == 32 and static_int(free) is None and static_int(7) == 7 and static_int(True) is None


@pytest.mark.parametrize("inner", ["eager", pytest.param("auto", marks=pytest.mark.slow)])
def test_budget_above_a_symbolic_store_is_exact(inner):
    """Case (issue 25): one compiled function used with stores of 64 then 128 and 96 slots
    (the later graphs have a symbolic capacity): budget 1000 gives exact attention on every
    graph — selection, refinement and page rescue keep every position — instead of a top-k
    of more elements than there are candidates."""
    model = tiny_llama(layers=2)
    forward = torch.compile(model.forward, backend="specontext", options={"budget": 1000, "inner": inner})
    for capacity, length in ((64, 40), (128, 100), (96, 70)):
        ids = _ids(length, seed=capacity)
        got = decode_logits(None, forward, ids, 3, sc.SpeContextCache(model.config, max_cache_len=capacity))
        want = decode_logits(None, model.forward, ids, 3, sc.SpeContextCache(model.config, max_cache_len=capacity))
        torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=ATOL, rtol=0)
    counts = sc.path_counts(model)
    # the static 64-slot graph takes the dense shortcut; the symbolic graphs gather every position
    assert counts["decode_steps"] == 9 and counts["dense_store_sites"] == 3 * 2, counts
    assert counts["gather_sites"] == 6 * 2, counts


def test_refinement_with_a_budget_above_its_candidates_keeps_them_all():
    """refine_selection with budget > candidates (a symbolic store's selection): every valid
    candidate is kept, none invented; exact attention follows."""
    torch.manual_seed(0)
    query = torch.randn(1, 4, 1, 8)
    keys = torch.randn(1, 2, 20, 8)
    length = torch.tensor(20)
    candidates = torch.tensor([[[-1, 0, 3, 5, 9, 19], [-1, 1, 2, 4, 8, 19]]])
    kept = aten_step.refine_selection(query, keys, candidates, length, None, (),
                                      StepSpec(50, 50, sink_tokens=1, recent_window=2), AttentionVariant(8 ** -0.5))
    kept = kept[0] if isinstance(kept, tuple) else kept
    for head in range(2):
        assert sorted(int(p) for p in kept[0, head] if p >= 0) == sorted(int(p) for p in candidates[0, head] if p >= 0)


def test_output_attentions_reason_names_it_not_the_cache(caplog):
    """Case output_attentions_diagnostic: with output_attentions=True the sites stay dense
    and exact (weights returned are the model's), and the WARNING names the weights, not
    Hugging Face's DynamicCache."""
    model = tiny_llama(layers=2, attn="eager")
    forward = torch.compile(model.forward, backend="specontext", options={**SMALL, "inner": "eager"})
    ids = _ids(30, seed=11)
    with caplog.at_level(logging.WARNING, logger="specontext_compile"), torch.no_grad():
        cache = sc.SpeContextCache(model.config, max_cache_len=40)
        out = forward(input_ids=ids, cache=cache, use_cache=True, output_attentions=True)
        ref = model.forward(input_ids=ids, cache=sc.SpeContextCache(model.config, max_cache_len=40),
                            use_cache=True, output_attentions=True)
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "output_attentions=True" in text and "DynamicCache" not in text, text


def test_backward_through_an_overwritten_step_names_what_is_supported():
    """What backward supports (compiled path): a step's backward works until a later step
    writes its saved inputs in place (the KV store, its length); then the error says so
    instead of autograd's bare version-counter message."""
    def step(weight, length):
        return weight * length  # saves ``length`` for the weight's gradient

    checked = _checked_backward(step)
    weight = torch.ones(3, requires_grad=True)
    length = torch.tensor(2.0)
    checked(weight, length).sum().backward()  # one step: works
    assert torch.equal(weight.grad, torch.full((3,), 2.0))
    out = checked(weight, length)
    length.add_(1)  # the next step's in-place write
    with pytest.raises(RuntimeError, match="specontext: backward through a compiled specontext step") as err:
        out.sum().backward()
    assert BACKWARD_SUPPORT in str(err.value)


def test_a_full_static_cache_error_names_hugging_faces_cache():
    """Case decode_past_cache_capacity: writing past a StaticCache's max_cache_len raises
    before the write, naming the cache the caller passed and its max_cache_len; the
    runtime's own cache keeps its own message."""
    from specontext_compile.runtime.ops_store import CacheCapacityError

    model = tiny_llama(layers=2)
    forward = torch.compile(model.forward, backend="specontext", options={**SMALL, "inner": "eager"})
    cache = StaticCache(config=model.config, max_cache_len=22)
    with pytest.raises(CacheCapacityError, match=r"Hugging Face's StaticCache is full: 22 \+ 1 tokens > capacity 22"):
        decode_logits(None, forward, _ids(20, seed=12), 3, cache)
    assert int(cache.get_seq_length()) == 22  # nothing written past the end
    with pytest.raises(CacheCapacityError, match="SpeContextCache is full"):
        decode_logits(None, forward, _ids(20, seed=12), 3, sc.SpeContextCache(model.config, max_cache_len=22))


@pytest.mark.parametrize("inner", ["eager", pytest.param("auto", marks=pytest.mark.slow)])
def test_a_step_with_gradients_enabled_keeps_its_state_out_of_autograd(inner):
    """Case grad_enabled_decode_step: called without ``torch.no_grad()``, a decode step
    gives the no-grad logits, the retrieval state it records carries no autograd history
    (selection state, not a differentiable value), and backward either runs or raises an
    error that names the sparse op's missing gradient, never a bare version-counter error."""
    model = tiny_llama(layers=2)
    ids = _ids(30, seed=5)
    forward = torch.compile(model.forward, backend="specontext", options={**SMALL, "inner": inner})
    reference = sc.SpeContextCache(model.config, max_cache_len=40)
    with torch.no_grad():
        token = forward(input_ids=ids, cache=reference, use_cache=True).logits[:, -1:].argmax(-1)
        want = forward(input_ids=token, cache=reference, use_cache=True).logits
    cache = sc.SpeContextCache(model.config, max_cache_len=40)
    forward(input_ids=ids, cache=cache, use_cache=True)
    assert not cache.query_state.requires_grad and cache.query_state.grad_fn is None
    out = forward(input_ids=token, cache=cache, use_cache=True)
    torch.testing.assert_close(out.logits.detach(), want, atol=1e-5, rtol=0)
    assert cache.path_counts()["gather_sites"] == 2  # the sparse path ran, one step, two layers
    try:
        out.logits.sum().backward()
    except RuntimeError as err:
        assert "specontext" in str(err) or "autograd formula" in str(err), str(err)
    else:
        assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_a_step_after_a_prefill_without_the_backend_counts_its_recency_fallback():
    """A prompt prefilled by the plain model records no lagged query, so the first compiled
    decode step's selection ranks by recency: ``path_counts()["recency_fallback_steps"]``
    counts it (on the device, in the lowered step), the next steps record and use their
    queries (no more fallbacks), and a cache prefilled through the backend counts none."""
    model = tiny_llama(layers=2)
    ids = _ids(40, seed=13)
    forward = torch.compile(model.forward, backend="specontext", options={**SMALL, "inner": "eager"})
    plain = sc.SpeContextCache(model.config, max_cache_len=48)
    with torch.no_grad():
        token = model(input_ids=ids, cache=plain, use_cache=True).logits[:, -1:].argmax(-1)  # no backend
        for _ in range(3):
            token = forward(input_ids=token, cache=plain, use_cache=True).logits[:, -1:].argmax(-1)
    assert plain.path_counts()["decode_steps"] == 3
    assert plain.path_counts()["recency_fallback_steps"] == 1
    through = sc.SpeContextCache(model.config, max_cache_len=48)
    decode_logits(model, forward, ids, 3, through)
    assert through.path_counts()["decode_steps"] == 3 and through.path_counts()["recency_fallback_steps"] == 0
