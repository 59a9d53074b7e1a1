"""The recall probe (specontext_compile/recall.py): measured from the attention nodes of the
lowered step, run by an fx.Interpreter, with nothing in the step's own functions.

References: :func:`selection_recall` (float64 dense attention) recomputed here from the
kept indices the step returns; the eager step's logits (``inner="eager"``) bit for bit.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import specontext_compile as sc
from specontext_compile import recall
from specontext_compile.recall import RecallProbe, selection_recall, site_recall
from specontext_compile.runtime import aten_step
from specontext_compile.runtime.offload import enable_offload
from _tiny import tiny_llama

PROMPT, CAP, STEPS = 60, 96, 4
OPTS = {"budget": 16, "recent_window": 4, "sink_tokens": 2}


def _ids(seed=0):
    return torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(seed))


def _decode(forward, cache, ids, steps, probe=None):
    """Prefill, then greedy decode; (logits of each decode call, recall record per call)."""
    logits, records = [], []
    with torch.no_grad():
        token = forward(input_ids=ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(steps):
            if probe is None:
                out = forward(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
            else:
                with probe.recording() as record:
                    out = forward(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
                records.append(record.values)
            logits.append(out)
            token = out.argmax(-1, keepdim=True)
    return logits, records


def _compiled(model, options):
    torch._dynamo.reset()
    return torch.compile(model.forward, backend="specontext", options=options)


def test_the_probe_runs_the_eager_step_and_records_one_recall_per_layer():
    """Same logits as ``inner="eager"`` bit for bit; one value per layer per recorded step,
    each in (0, 1) with a budget below the context (not all 1.0: the selection is sparse);
    nothing is recorded outside ``recording()``."""
    model, ids = tiny_llama(layers=3), _ids()
    want, _ = _decode(_compiled(model, dict(OPTS, inner="eager")), sc.SpeContextCache(model.config, max_cache_len=CAP),
                      ids, STEPS)
    probe = RecallProbe()
    cache = sc.SpeContextCache(model.config, max_cache_len=CAP)
    got, records = _decode(_compiled(model, dict(OPTS, inner=probe.runner)), cache, ids, STEPS, probe)
    for step, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"decode step {step}")
    assert [len(r) for r in records] == [3] * STEPS
    values = [v for r in records for v in r]
    assert all(0.0 < v < 1.0 for v in values), values
    assert cache.path_counts()["gather_sites"] == 3 * STEPS  # the sparse path ran, not the dense store


def test_the_probe_value_is_the_float64_recall_of_the_indices_the_step_kept(monkeypatch):
    """Each recorded value equals selection_recall recomputed from the arguments the step's
    attention was called with (captured by a spy set before compiling)."""
    seen = []
    real = aten_step.sparse_attention

    def spy(query, key_cache, value_cache, indices, length, attn_mask, spec, variant):
        seen.append(selection_recall(query, key_cache, indices, int(length), variant.scale, attn_mask,
                                     variant.soft_cap, variant.sliding_window))
        return real(query, key_cache, value_cache, indices, length, attn_mask, spec, variant)

    monkeypatch.setattr(aten_step, "sparse_attention", spy)  # the lowering inserts what it finds there
    monkeypatch.setitem(recall._SITES, spy, recall._SITES[real])
    model, ids = tiny_llama(layers=2), _ids(3)
    probe = RecallProbe()
    _, records = _decode(_compiled(model, dict(OPTS, inner=probe.runner)),
                         sc.SpeContextCache(model.config, max_cache_len=CAP), ids, 2, probe)
    decode_calls = seen[-4:]  # the last two steps' two layers (prefill runs dense, not this function)
    assert [v for r in records for v in r] == pytest.approx(decode_calls, abs=1e-12)


class _SizedAfterPrefill:
    """A compiled forward with KV offload whose device tier, sized after prefill, holds no
    layer at the first decode step: every layer's KV is then read from the host tier."""

    def __init__(self, forward, manager):
        self.forward, self.manager, self.sized = forward, manager, False

    def __call__(self, **kwargs):
        out = self.forward(**kwargs)
        if not self.sized:
            model = self.manager.prepare()
            self.manager.prepare(model.device_bytes(PROMPT + 1, model.offloadable))
            self.sized = True
        return out


def test_offloaded_layers_record_the_resident_recall():
    """Layers whose KV lives in the host tier (``offload_step.attention``) are measured too,
    and equal the resident run's values: the same selections over the same bits."""
    model, ids = tiny_llama(layers=3), _ids(1)
    options = dict(OPTS, page_rescue=0)
    probe = RecallProbe()
    _, resident = _decode(_compiled(model, dict(options, inner=probe.runner)),
                          sc.SpeContextCache(model.config, max_cache_len=CAP, chunk_tokens=CAP), ids, STEPS, probe)
    probe = RecallProbe()
    forward = _compiled(model, dict(options, inner=probe.runner, device_memory_bytes=1 << 40))
    cache = sc.SpeContextCache(model.config, max_cache_len=CAP, chunk_tokens=CAP)
    manager = enable_offload(cache, model, 1 << 40, options["budget"])
    before = counters["specontext"]["offloaded_attention_calls"]
    _, offloaded = _decode(_SizedAfterPrefill(forward, manager), cache, ids, STEPS, probe)
    assert sorted(manager.offloaded) == [0, 1, 2]
    assert counters["specontext"]["offloaded_attention_calls"] - before == 3 * STEPS
    assert offloaded == resident
    assert all(len(r) == 3 for r in offloaded)


def test_a_node_that_is_not_an_attention_is_not_measured():
    assert site_recall(torch.ops.aten.add.Tensor, (torch.ones(1), torch.ones(1)), {}) is None
    assert site_recall(aten_step.covers_store, (torch.zeros(1, 1, 1), torch.zeros(1, 1, 1, 1)), {}) is None


@pytest.mark.parametrize("budget, full, lower", [(8, False, True), (64, True, True), (8, False, False)],
                         ids=["sparse", "full", "op-chain"])
def test_mla_sites_are_measured_on_the_latent_keys(budget, full, lower):
    """Tiny DeepSeek-V3 (MLA, two layers): one value per layer per step, 1.0 when the budget
    holds every token, below 1.0 for 8 of ~31 tokens; also on the op chain (``lower=False``),
    where each site is the ``sparse_attention`` op with an MLA variant."""
    from _families import tiny_family

    model = tiny_family("deepseek_v3", "sdpa")
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    probe = RecallProbe()
    _, records = _decode(_compiled(model, {"budget": budget, "inner": probe.runner, "lower": lower}),
                         sc.SpeContextCache(model.config, max_cache_len=64), ids, 3, probe)
    values = [v for r in records for v in r]
    assert [len(r) for r in records] == [2] * 3
    if full:
        assert min(values) > 1 - 1e-9, values
    else:
        assert all(0.0 < v < 1.0 - 1e-6 for v in values), values


def test_a_layer_the_fidelity_guard_ran_dense_records_full_recall():
    """``min_coverage=0.45`` sends some layers of this random model dense and not others
    (``guarded_attention``'s ``dense``; 16 of ~62 tokens keep about 0.26 of the mass here):
    the dense ones record 1.0, as many as the step's ``guard_dense_sites`` counter."""
    model, ids = tiny_llama(layers=3), _ids(2)
    probe = RecallProbe()
    cache = sc.SpeContextCache(model.config, max_cache_len=CAP)
    _, records = _decode(_compiled(model, dict(OPTS, inner=probe.runner, min_coverage=0.45)), cache, ids, STEPS,
                         probe)
    values = [v for r in records for v in r]
    dense = cache.path_counts()["guard_dense_sites"]
    assert len(values) == 3 * STEPS and 0 < dense < len(values), (dense, values)
    assert sum(v == 1.0 for v in values) == dense
    assert all(v < 1.0 for v in values if v != 1.0)


def test_a_selection_naming_every_slot_of_the_store_has_full_recall():
    """The dense route's selection (``aten_step.every_slot``) names every slot of the store,
    written or not: the unwritten ones count as nothing (SmolLM2's probe raised an index
    error on them), the written ones as kept; a half of the written slots gives less."""
    gen = torch.Generator().manual_seed(0)
    query, keys = torch.randn(1, 4, 1, 8, generator=gen), torch.randn(1, 2, 32, 8, generator=gen)
    every = aten_step.every_slot(keys)
    assert every.shape[-1] == 32
    assert selection_recall(query, keys, every, 20, 8 ** -0.5, None) == pytest.approx(1.0, abs=1e-12)
    half = torch.arange(10).expand(1, 2, 10)
    assert selection_recall(query, keys, half, 20, 8 ** -0.5, None) < 1.0 - 1e-6
