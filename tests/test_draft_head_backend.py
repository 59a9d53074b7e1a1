"""The draft retrieval head (option ``retrieval_head``) as the backend's selection (issue 6).

Heads are random, embedding-only, written in the EAGLE-3 layout with ``runtime/distill.py``'s
``save_head``; the target is a tiny random Llama (6 query heads over 2 KV heads).
"""

import pytest
import torch
from _tiny import decode_graph_ops, tiny_llama
from test_backend_e2e import assert_gather_path, assert_same_greedy_tokens, decode_logits
from torch._dynamo.utils import counters
from transformers import DynamicCache

import specontext_compile as sc
from specontext_compile.config import SpeContextConfig
from specontext_compile.runtime import aten_step
from specontext_compile.runtime.distill import save_head
from specontext_compile.runtime.eagle3 import Eagle3RetrievalHead, load_eagle3_head

# fp32 gather path (dense_shortcut=False at full budget) vs eager SDPA, observed max |logit
# diff| <= 3e-7 here (2e-7 in test_backend_e2e); bound with margin. Greedy tokens must be equal.
ATOL, RTOL = 1e-4, 1e-4


def write_head(folder, model, heads=2, kv_heads=2, head_dim=16, seed=0, variant="embedding", embed=False,
               aux=(0, 1, 2)):
    """A random head for ``model`` (embedding-only, or ``variant="fused"`` reading the outputs
    of layers ``aux``; its embedding is the target's unless ``embed``), saved with
    ``save_head``; returns the folder."""
    cfg = model.config
    hidden = cfg.hidden_size
    gen = torch.Generator().manual_seed(seed)
    fc = torch.randn(hidden, 3 * hidden, generator=gen) * 0.2 if variant == "fused" else torch.zeros(hidden, 3 * hidden)
    tensors = {
        "fc.weight": fc,
        "midlayer.input_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": torch.randn(heads * head_dim, 2 * hidden, generator=gen) * 0.3,
        "midlayer.self_attn.k_proj.weight": torch.randn(kv_heads * head_dim, 2 * hidden, generator=gen) * 0.3,
    }
    config = {
        "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.vocab_size,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux)}, "specontext_variant": variant,
    }
    head = Eagle3RetrievalHead(config, tensors, model.model.embed_tokens.weight.detach())
    save_head(head, config, folder, {"test": True})
    if embed:  # a checkpoint with its own embedding (as some EAGLE-3 drafts ship)
        from safetensors.torch import load_file, save_file

        stored = load_file(str(folder / "model.safetensors"))
        stored["embed_tokens.weight"] = torch.randn(cfg.vocab_size, hidden, generator=gen)
        save_file(stored, str(folder / "model.safetensors"))
    return folder


def options(folder, **extra):
    """Backend options; the op chain runs eagerly (``inner="eager", lower=False``: the attention
    ops called with their Python bodies) so that the attention ops' counters
    (``sparse_attention_calls``, ``gather_attention_calls``) and the spies see every call; the
    selection is the same direct call of ``scorers.head_select`` (head ``"draft"``) on every path (counted
    by ``path_counts()["decode_steps"]``); the lowered step is checked against it by
    ``test_inductor_inner_matches_eager_inner``."""
    opts = {"retrieval_head": str(folder), "inner": "eager", **extra}
    if opts["inner"] == "eager":
        opts.setdefault("lower", False)
    return opts


def spy_selections(monkeypatch):
    """Record (indices, length) of every torch-path sparse attention call."""
    seen = []
    real = aten_step.sparse_attention_reference

    def spy(query, key_cache, value_cache, indices, length, *args):
        seen.append((indices.clone(), int(length)))
        return real(query, key_cache, value_cache, indices, length, *args)

    monkeypatch.setattr(aten_step, "sparse_attention_reference", spy)
    return seen


def reference_head_scores(model, folder, ids, aux=None):
    """Hand-computed draft-head attention of every position over every earlier one:
    ``[batch, head_kv_heads, T, T]`` group-max softmax weights (causal), and the head's K.
    ``aux``: each position's auxiliary hidden states (already the previous token's); zeros
    when None."""
    head, _ = load_eagle3_head(folder, model.model.embed_tokens.weight.detach())
    t = ids.shape[1]
    aux = torch.zeros(1, t, head.fc.shape[1]) if aux is None else aux
    q, k = head(ids, aux, torch.arange(t)[None])
    groups = head.num_heads // head.num_kv_heads
    logits = (q @ k.repeat_interleave(groups, 1).transpose(-1, -2)) * head.head_dim**-0.5  # [1, Hq, T, T]
    causal = torch.ones(t, t, dtype=torch.bool).triu(1)
    probs = logits.masked_fill(causal, float("-inf")).softmax(-1)
    return probs.view(1, head.num_kv_heads, groups, t, t).amax(2), k


def to_target_heads(scores, target_kv):
    """The documented KV-head mapping, written out for the three cases tested."""
    hd = scores.shape[1]
    if hd == target_kv:
        return scores
    if hd == 1:
        return scores.expand(-1, target_kv, -1)
    return torch.stack([scores[:, j * hd // target_kv:(j + 1) * hd // target_kv].amax(1) for j in range(target_kv)], 1)


def reference_selection(row_scores, total, budget, sink, window):
    """Sinks + recent window + top-k of the rest, as sets per target KV head."""
    forced = set(range(sink)) | set(range(total - window, total))
    cand = torch.arange(sink, total - window)
    out = []
    for h in range(row_scores.shape[0]):
        top = cand[row_scores[h, sink:total - window].topk(budget - len(forced)).indices]
        out.append(forced | set(top.tolist()))
    return out


def assert_exact_with_full_budget(model, folder, seed):
    """Prefill + 20 greedy steps with a budget covering the context equal eager dense (logits
    and greedy tokens), on the gather path: the dense shortcut is off (else every site would
    run SDPA over the store, issue 12) and both the ops' counters (``inner="eager"``) and the
    step's own path counters say that every site gathered. Returns (decode-graph compile
    reports, prompt ids, sparse logits per call, cache)."""
    ids = torch.randint(0, 128, (1, 37), generator=torch.Generator().manual_seed(seed))
    eager = decode_logits(model, model.forward, ids, 20, DynamicCache(config=model.config))
    compiled = torch.compile(model.forward, backend="specontext",
                             options=options(folder, budget=64, dense_shortcut=False))
    cache = sc.SpeContextCache(model.config, max_cache_len=64, retrieval_head=str(folder))
    sparse = decode_logits(model, compiled, ids, 20, cache)
    for step, (a, b) in enumerate(zip(sparse, eager)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=f"step {step}")
    assert_same_greedy_tokens(sparse, eager)
    sites = len(model.model.layers) * 20
    assert counters["specontext"]["dense_prefix_calls"] == 0
    assert counters["specontext"]["gather_attention_calls"] == counters["specontext"]["sparse_attention_calls"] == sites
    assert_gather_path(cache, sites)
    return [r for r in sc.compile_reports() if r.result.phase == "decode"], ids, sparse, cache


def test_full_budget_is_exact_over_prefill_and_20_steps(tmp_path):
    model = tiny_llama(layers=4)
    folder = write_head(tmp_path, model)
    decode, _, _, cache = assert_exact_with_full_budget(model, folder, seed=0)
    assert len(decode) == 1 and (decode[0].sites_total, decode[0].sites_rewritten) == (4, 4)
    assert decode[0].result.selection_head == f"draft:{folder.resolve()}"
    assert decode[0].result.retrieval_layers == ()  # no lagged-query recording
    assert decode_graph_ops("head_select", "draft") == 1 and decode_graph_ops("head_select", "lagged-query") == 0
    assert cache.path_counts()["decode_steps"] == 20
    assert counters["specontext"]["sparse_attention_calls"] == 4 * 20


# (head query heads, head KV heads, own embedding): equal to the target's 2 KV heads,
# one KV head broadcast to both, and 4 KV heads max-reduced in pairs
HEADS = [(2, 2, False), (3, 1, False), (4, 4, True)]


@pytest.mark.parametrize("heads, kv_heads, embed", HEADS)
def test_small_budget_selection_equals_the_hand_computed_one(tmp_path, monkeypatch, heads, kv_heads, embed):
    seen = spy_selections(monkeypatch)
    model = tiny_llama(layers=2)
    folder = write_head(tmp_path, model, heads=heads, kv_heads=kv_heads, embed=embed, seed=kv_heads)
    prompt = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(1))
    budget, sink, window = 16, 2, 4
    compiled = torch.compile(model.forward, backend="specontext",
                             options=options(folder, budget=budget, sink_tokens=sink, recent_window=window,
                                             page_rescue=0))  # the head's own selection, not refined
    cache = sc.SpeContextCache(model.config, max_cache_len=80, retrieval_head=str(folder))
    tokens = [prompt]
    with torch.no_grad():
        logits = compiled(input_ids=prompt, cache=cache, use_cache=True).logits[:, -1]
        for _ in range(6):
            nxt = logits.argmax(-1, keepdim=True)
            tokens.append(nxt)
            logits = compiled(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1]
    ids = torch.cat(tokens, 1)  # every token the cache holds, in position order
    assert len(seen) == 2 * 6 and cache.path_counts()["decode_steps"] == 6
    probs, _ = reference_head_scores(model, folder, ids)
    for step in range(6):
        indices, length = seen[2 * step]  # layer 0 (layer 1 reads the same selection)
        assert torch.equal(indices, seen[2 * step + 1][0])
        total = 61 + step
        assert length == total
        scores = to_target_heads(probs[:, :, total - 1, :total], 2)[0]
        expected = reference_selection(scores, total, budget, sink, window)
        got = [set(indices[0, h].tolist()) for h in range(2)]
        assert got == expected, f"step {step}: {got} != {expected}"


def test_draft_key_cache_holds_k_of_every_position(tmp_path):
    model = tiny_llama(layers=2)
    folder = write_head(tmp_path, model, heads=4, kv_heads=2)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(model.forward, backend="specontext", options=options(folder, budget=8, recent_window=4))
    cache = sc.SpeContextCache(model.config, max_cache_len=48, retrieval_head=str(folder))
    tokens = [ids]
    with torch.no_grad():
        logits = compiled(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        assert int(cache.draft.length) == 30
        for _ in range(7):
            tokens.append(logits.argmax(-1, keepdim=True))
            logits = compiled(input_ids=tokens[-1], cache=cache, use_cache=True).logits[:, -1]
    all_ids = torch.cat(tokens, 1)
    _, k = reference_head_scores(model, folder, all_ids)
    assert int(cache.draft.length) == 37 == int(cache.layers[0].cumulative_length)
    assert cache.draft.keys.shape == (1, 2, cache.layers[0].keys.shape[2], 16)
    torch.testing.assert_close(cache.draft.keys[:, :, :37], k, atol=1e-5, rtol=1e-5)
    assert cache.draft.nbytes == cache.draft.keys.numel() * 4
    cache.reset()
    assert int(cache.draft.length) == 0


def test_bad_head_paths_are_value_errors_naming_the_fix(tmp_path):
    model = tiny_llama(layers=1)
    with pytest.raises(ValueError, match="is not a folder"):
        SpeContextConfig(retrieval_head=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no config.json.*specontext distill"):
        SpeContextConfig.from_options({"retrieval_head": str(tmp_path / "empty")})
    fused = write_head(tmp_path / "fused", model, variant="fused", aux=())
    with pytest.raises(ValueError, match="a fused head needs eagle_aux_hidden_state_layer_ids"):
        SpeContextConfig(retrieval_head=str(fused))
    good = write_head(tmp_path / "good", model)
    (good / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="holds no model.safetensors"):
        sc.compile(model, retrieval_head=str(good))
    with pytest.raises(ValueError, match="is not a folder"):
        sc.SpeContextCache(model.config, retrieval_head=str(tmp_path / "missing"))
    ok = write_head(tmp_path / "ok", model)
    with pytest.raises(ValueError, match="cannot be combined"):
        SpeContextConfig(retrieval_head=str(ok), device_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="must be a folder path"):
        SpeContextConfig(retrieval_head=3)


def test_cache_without_the_draft_store_keeps_attention_dense_with_a_reason(tmp_path):
    model = tiny_llama(layers=2)
    folder = write_head(tmp_path, model)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    eager = decode_logits(model, model.forward, ids, 3, DynamicCache(config=model.config))
    compiled = torch.compile(model.forward, backend="specontext", options=options(folder, budget=8))
    dense = decode_logits(model, compiled, ids, 3, sc.SpeContextCache(model.config, max_cache_len=48))
    for a, b in zip(dense, eager):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    decode = [r for r in sc.compile_reports() if r.result.phase == "decode"]
    assert decode and all(r.sites_rewritten == 0 for r in decode)
    assert all("retrieval_head=DIR" in reason for r in decode for _, reason in r.result.fallbacks())


def test_no_token_embedding_in_the_graph_keeps_attention_dense(tmp_path):
    model = tiny_llama(layers=2)
    folder = write_head(tmp_path, model)
    embed = model.model.embed_tokens
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(4))
    compiled = torch.compile(model.forward, backend="specontext", options=options(folder, budget=8))
    cache = sc.SpeContextCache(model.config, max_cache_len=48, retrieval_head=str(folder))
    with torch.no_grad():  # inputs_embeds: the graph holds no embedding call
        logits = compiled(inputs_embeds=embed(ids), cache=cache, use_cache=True).logits[:, -1]
        compiled(inputs_embeds=embed(logits.argmax(-1, keepdim=True)), cache=cache, use_cache=True)
    decode = [r for r in sc.compile_reports() if r.result.phase == "decode"]
    assert decode and decode[0].sites_rewritten == 0
    assert all("token embeddings" in reason for _, reason in decode[0].result.fallbacks())
    assert decode_graph_ops("head_select") == 0 and cache.path_counts()["decode_steps"] == 0


@pytest.mark.slow
def test_compile_helper_and_explain_use_the_draft_head(tmp_path):
    from specontext_compile.explain_report import explain

    model = tiny_llama(layers=2)
    folder = write_head(tmp_path, model)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(5))
    ref = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    # default: inductor, head_select lowered; the gather path (not SDPA over the store)
    sc.compile(model, budget=64, retrieval_head=str(folder), dense_shortcut=False)
    cache = sc.api.make_cache(model, ids, 10)
    out = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, cache=cache)
    assert torch.equal(out, ref)  # budget >= context: exact
    assert cache.path_counts()["decode_steps"] == 9
    assert_gather_path(cache, 2 * 9)
    sc.api.restore(model)
    result = explain(model, ids, budget=8, retrieval_head=str(folder))
    table = result.table()
    assert "selection head: graph 1: draft head" in table and "embedding-only" in table
    assert "draft_select" in table
    lagged = explain(model, ids, budget=8)
    assert "lagged query of layers" in lagged.table()


@pytest.mark.slow  # fast tier on the 2-core Xeon (docs/testing.md)
def test_a_second_compile_of_the_model_with_a_draft_head_runs(tmp_path, caplog):
    """Field case: ``explain`` after ``specontext_compile.compile`` and a generate (a second
    ``torch.compile`` of the same forward, whose sizes dynamo already made dynamic) failed with
    ``NameError: name 's40' is not defined`` in inductor's code for a region: dynamo had
    replaced the region's size inputs' symbol by another one that only a later region's inputs
    bind. Such a graph is now compiled whole, with the reason at DEBUG, and the step runs."""
    from specontext_compile.explain_report import explain

    model = tiny_llama(layers=2)
    folder = write_head(tmp_path, model)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(5))
    sc.compile(model, budget=64, retrieval_head=str(folder))
    cache = sc.api.make_cache(model, ids, 3)
    model.generate(ids, max_new_tokens=3, do_sample=False, cache=cache)
    sc.api.restore(model)
    with caplog.at_level("DEBUG", logger="specontext_compile.regional"):
        result = explain(model, ids, budget=8, retrieval_head=str(folder))
    assert "size symbols its inputs do not bind" in caplog.text
    assert result.counters["step.decode_steps"] == 1 and result.counters["step.gather_sites"] == 2


def test_eager_prefill_falls_back_to_recent_tokens(tmp_path):
    model = tiny_llama(layers=2)
    folder = write_head(tmp_path, model)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(6))
    cache = sc.SpeContextCache(model.config, max_cache_len=48, retrieval_head=str(folder))
    compiled = torch.compile(model.forward, backend="specontext", options=options(folder, budget=8))
    with torch.no_grad():
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]  # eager: no head K
        compiled(input_ids=logits.argmax(-1, keepdim=True), cache=cache, use_cache=True)
    assert int(cache.draft.length) == 0  # never claims positions it did not write
    assert cache.path_counts()["recency_fallback_steps"] == 1  # counted by the step itself
    assert cache.path_counts()["decode_steps"] == 1


def test_cli_run_accepts_retrieval_head(tmp_path, monkeypatch):
    from specontext_compile import cli

    seen = {}
    monkeypatch.setattr("specontext_compile.models.load_model", lambda name: (None, None))

    def fake_run_report(model, tokenizer, text, **kw):
        seen.update(kw)
        raise SystemExit(0)

    monkeypatch.setattr("specontext_compile.report.run_report", fake_run_report)
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    folder = write_head(tmp_path / "head", tiny_llama(layers=1))
    with pytest.raises(SystemExit):
        cli.main(["run", "--prompt-file", str(prompt), "--retrieval-head", str(folder)])
    assert seen["retrieval_head"] == str(folder.resolve())
    assert cli.main(["run", "--prompt-file", str(prompt), "--retrieval-head", str(tmp_path / "nope")]) == 2


@pytest.mark.slow
def test_cli_explain_names_the_draft_head(tmp_path, capsys):
    from specontext_compile import cli
    from specontext_compile.tiny_models import tiny_family

    folder = write_head(tmp_path / "head", tiny_family("llama", "sdpa"))
    assert cli.main(["explain", "--model", "tiny:llama", "--budget", "16", "--prompt-tokens", "40",
                     "--retrieval-head", str(folder)]) == 0
    printed = capsys.readouterr().out
    assert "draft head" in printed and "lagged query" not in printed


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["embedding", "fused"])
def test_smollm2_with_a_draft_head(smollm2, tmp_path, variant):
    from test_smollm2 import real_prompt

    model, tokenizer = smollm2
    cfg = model.config
    d, kv = cfg.hidden_size // cfg.num_attention_heads, cfg.num_key_value_heads
    attn = model.model.layers[8].self_attn  # the distill recipe's start: layer 8's projections
    groups = cfg.num_attention_heads // kv
    q_rows = torch.cat([attn.q_proj.weight[h * groups * d:(h * groups + 1) * d] for h in range(kv)])
    zeros = torch.zeros(kv * d, cfg.hidden_size)
    if variant == "fused":  # the fused half of the input then moves Q and K
        zeros = torch.randn(kv * d, cfg.hidden_size, generator=torch.Generator().manual_seed(1)) * 0.02
    fc = torch.randn(cfg.hidden_size, 3 * cfg.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.02
    tensors = {
        "fc.weight": fc if variant == "fused" else torch.zeros_like(fc),
        "midlayer.input_layernorm.weight": model.model.layers[8].input_layernorm.weight.detach(),
        "midlayer.hidden_norm.weight": torch.ones(cfg.hidden_size),
        "midlayer.self_attn.q_proj.weight": torch.cat([q_rows.detach(), zeros], 1),
        "midlayer.self_attn.k_proj.weight": torch.cat([attn.k_proj.weight.detach(), zeros], 1),
    }
    config = {"hidden_size": cfg.hidden_size, "num_attention_heads": kv, "num_key_value_heads": kv,
              "head_dim": d, "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.vocab_size,
              "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": 100000.0, "specontext_variant": variant,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 28]}}
    save_head(Eagle3RetrievalHead(config, tensors, model.model.embed_tokens.weight.detach()), config, tmp_path, {})
    ids = real_prompt(tokenizer, 300)
    compiled = torch.compile(model.forward, backend="specontext", options=options(tmp_path, budget=128))
    cache = sc.SpeContextCache(model.config, max_cache_len=320, retrieval_head=str(tmp_path))
    logits = decode_logits(model, compiled, ids, 10, cache)
    assert all(torch.isfinite(x).all() for x in logits)
    decode = [r for r in sc.compile_reports() if r.result.phase == "decode"]
    assert [(r.sites_total, r.sites_rewritten) for r in decode] == [(30, 30)]
    assert cache.path_counts()["decode_steps"] == 10
    assert cache.path_counts()["recency_fallback_steps"] == 0
    assert int(cache.draft.length) == 310
    # recorded only for fused heads: row 0 holds the last position's (309: stamped 310)
    assert int(cache.draft.aux_valid.max()) == (310 if variant == "fused" else 0)


def test_inductor_inner_matches_eager_inner(tmp_path):
    model = tiny_llama(layers=2)
    folder = write_head(tmp_path, model, variant="fused", aux=(0, 1, 0))
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(7))
    runs = {}
    for inner in ("eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, backend="specontext",
                                 options=options(folder, budget=16, recent_window=4, sink_tokens=2, inner=inner))
        cache = sc.SpeContextCache(model.config, max_cache_len=48, retrieval_head=str(folder))
        runs[inner] = (decode_logits(model, compiled, ids, 3, cache), cache.draft.keys[:, :, :43].clone())
    for a, b in zip(runs["inductor"][0], runs["eager"][0]):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(runs["inductor"][1], runs["eager"][1])  # K written under functionalization too


def test_kv_head_mapping_rules():
    from specontext_compile.runtime.draft_retrieval import map_to_target_heads

    s = torch.rand(2, 4, 5)
    torch.testing.assert_close(map_to_target_heads(s, 4), s)  # one to one
    torch.testing.assert_close(map_to_target_heads(s[:, :1], 3), s[:, :1].expand(2, 3, 5))  # broadcast
    torch.testing.assert_close(map_to_target_heads(s[:, :2], 4), s[:, [0, 0, 1, 1]])  # blocks
    torch.testing.assert_close(map_to_target_heads(s, 2), torch.stack([s[:, :2].amax(1), s[:, 2:].amax(1)], 1))
    torch.testing.assert_close(map_to_target_heads(s[:, :3], 2), s[:, :3].amax(1, keepdim=True).expand(2, 2, 5))


def test_cache_built_for_another_head_keeps_attention_dense(tmp_path):
    model = tiny_llama(layers=2)
    one, other = write_head(tmp_path / "one", model), write_head(tmp_path / "other", model, seed=1)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(8))
    compiled = torch.compile(model.forward, backend="specontext", options=options(one, budget=8))
    decode_logits(model, compiled, ids, 2, sc.SpeContextCache(model.config, max_cache_len=48, retrieval_head=str(other)))
    decode = [r for r in sc.compile_reports() if r.result.phase == "decode"]
    assert decode and decode[0].sites_rewritten == 0
    assert all("the cache's draft head is" in reason for _, reason in decode[0].result.fallbacks())
    assert decode_graph_ops("head_select") == 0


def previous_token_aux(hidden_states, layers):
    """EAGLE-3 input from HF ``hidden_states`` ``[1, T, hidden]`` per layer output: layer
    ``j``'s output is ``hidden_states[j + 1]``; position ``i`` gets position ``i - 1``'s."""
    aux = torch.cat([hidden_states[j + 1] for j in layers], -1)
    return torch.cat([torch.zeros_like(aux[:, :1]), aux[:, :-1]], 1)


def test_fused_head_full_budget_is_exact_and_keys_use_previous_hidden_states(tmp_path):
    model = tiny_llama(layers=4)  # aux layers before the last (HF's last entry is after the norm)
    folder = write_head(tmp_path, model, heads=4, kv_heads=2, variant="fused", aux=(0, 1, 2))
    decode, ids, sparse, cache = assert_exact_with_full_budget(model, folder, seed=9)
    assert [(r.sites_total, r.sites_rewritten) for r in decode] == [(4, 4)]
    assert cache.path_counts()["decode_steps"] == 20
    # every K from the dense model's hidden states (exact at this budget), previous token's
    tokens = torch.cat([ids] + [x.argmax(-1, keepdim=True) for x in sparse[:-1]], 1)
    with torch.no_grad():
        hs = model(tokens, output_hidden_states=True).hidden_states
    _, k = reference_head_scores(model, folder, tokens, previous_token_aux(hs, (0, 1, 2)))
    assert int(cache.draft.length) == tokens.shape[1] == 57
    torch.testing.assert_close(cache.draft.keys[:, :, :57], k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache.draft.aux_state[:, :1], torch.cat([hs[j + 1][:, -1:] for j in (0, 1, 2)], -1),
                               atol=1e-4, rtol=1e-4)


def test_fused_head_small_budget_selection_equals_the_hand_computed_one(tmp_path, monkeypatch):
    seen = spy_selections(monkeypatch)
    model = tiny_llama(layers=4)
    layers = (0, 2, 1)  # any order: concatenated as listed
    folder = write_head(tmp_path, model, heads=2, kv_heads=1, variant="fused", aux=layers)
    prompt = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(10))
    budget, sink, window = 16, 2, 4
    compiled = torch.compile(model.forward, backend="specontext",
                             options=options(folder, budget=budget, sink_tokens=sink, recent_window=window,
                                             page_rescue=0))  # the head's own selection, not refined
    cache = sc.SpeContextCache(model.config, max_cache_len=80, retrieval_head=str(folder))
    tokens, states = [prompt], []
    with torch.no_grad():  # the backend's own hidden states (sparse ones) feed the reference
        out = compiled(input_ids=prompt, cache=cache, use_cache=True, output_hidden_states=True)
        for _ in range(6):
            states.append(out.hidden_states)
            tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
            out = compiled(input_ids=tokens[-1], cache=cache, use_cache=True, output_hidden_states=True)
        states.append(out.hidden_states)
    ids = torch.cat(tokens, 1)
    hs = [torch.cat([s[i] for s in states], 1) for i in range(5)]
    probs, _ = reference_head_scores(model, folder, ids, previous_token_aux(hs, layers))
    assert len(seen) == 4 * 6
    for step in range(6):
        indices, length = seen[4 * step]
        total = 61 + step
        expected = reference_selection(to_target_heads(probs[:, :, total - 1, :total], 2)[0], total, budget, sink, window)
        assert [set(indices[0, h].tolist()) for h in range(2)] == expected, f"step {step}"


def test_fused_head_on_a_one_layer_model_stays_dense_with_a_reason(tmp_path):
    model = tiny_llama(layers=1)
    folder = write_head(tmp_path, model, variant="fused", aux=(0,))
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(11))
    compiled = torch.compile(model.forward, backend="specontext", options=options(folder, budget=8))
    decode_logits(model, compiled, ids, 1, sc.SpeContextCache(model.config, max_cache_len=40, retrieval_head=str(folder)))
    decode = [r for r in sc.compile_reports() if r.result.phase == "decode"]
    assert decode and decode[0].sites_rewritten == 0
    assert all("cannot tell decoder layers apart" in reason for _, reason in decode[0].result.fallbacks())


def test_fused_head_multi_token_step_stays_dense_and_keeps_the_key_cache_whole(tmp_path):
    model = tiny_llama(layers=3)
    folder = write_head(tmp_path, model, variant="fused", aux=(1, 0, 1))
    ids = torch.randint(0, 128, (1, 45), generator=torch.Generator().manual_seed(12))
    compiled = torch.compile(model.forward, backend="specontext",
                             options=options(folder, budget=64, max_sparse_q_len=16),  # 3 tokens: a decode step
                             dynamic=False)  # a static graph per step length
    cache = sc.SpeContextCache(model.config, max_cache_len=64, retrieval_head=str(folder))
    with torch.no_grad():
        compiled(input_ids=ids[:, :40], cache=cache, use_cache=True)
        compiled(input_ids=ids[:, 40:43], cache=cache, use_cache=True)  # 3 tokens: a "decode" step
        compiled(input_ids=ids[:, 43:44], cache=cache, use_cache=True)
        compiled(input_ids=ids[:, 44:45], cache=cache, use_cache=True)
        hs = model(ids, output_hidden_states=True).hidden_states
    three = [r for r in sc.compile_reports() if r.result.phase == "decode" and r.result.sites[0].q_len == 3]
    assert three and three[0].sites_rewritten == 0
    assert all("a step of 3 tokens" in reason for _, reason in three[0].result.fallbacks())
    assert cache.path_counts()["decode_steps"] == 2  # the two one-token steps selected
    _, k = reference_head_scores(model, folder, ids, previous_token_aux(hs, (1, 0, 1)))
    assert int(cache.draft.length) == 45
    torch.testing.assert_close(cache.draft.keys[:, :, :45], k, atol=1e-4, rtol=1e-4)
