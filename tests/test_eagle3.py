"""EAGLE-3 import and pruning, on a small checkpoint written in that layout by the test."""

import json

import pytest
import torch
from safetensors.torch import save_file
from specontext_compile.runtime import scorers
from specontext_compile.runtime.eagle3 import load_eagle3_head
from specontext_compile.runtime.protocol import is_op

H, HEADS, KV, D, VOCAB, DRAFT_VOCAB, INTER = 64, 4, 2, 16, 300, 100, 256


def write_checkpoint(folder, drop=None, reshape=None, embed=True):
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen) * 0.1
    tensors = {
        "fc.weight": r(H, 3 * H),
        "midlayer.input_layernorm.weight": 1 + r(H),
        "midlayer.hidden_norm.weight": 1 + r(H),
        "midlayer.self_attn.q_proj.weight": r(HEADS * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": r(KV * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(KV * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": r(H, HEADS * D),
        "midlayer.post_attention_layernorm.weight": r(H),
        "midlayer.mlp.gate_proj.weight": r(INTER, H),
        "midlayer.mlp.up_proj.weight": r(INTER, H),
        "midlayer.mlp.down_proj.weight": r(H, INTER),
        "norm.weight": r(H),
        "lm_head.weight": r(DRAFT_VOCAB, H),
        "d2t": torch.arange(DRAFT_VOCAB),
        "t2d": torch.zeros(VOCAB, dtype=torch.bool),
    }
    if embed:
        tensors["embed_tokens.weight"] = r(VOCAB, H)
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = r(3, 3)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": D,
              "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "rope_theta": 10000.0,
              "rms_norm_eps": 1e-6, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 9]}}
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


def test_import_keeps_only_attention_weight_producers(tmp_path):
    tensors = write_checkpoint(tmp_path)
    head, report = load_eagle3_head(tmp_path)
    kept = ["fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "embed_tokens.weight"]
    assert report.kept == sum(tensors[n].numel() for n in kept)
    assert report.total == sum(t.numel() for t in tensors.values())
    assert "lm_head.weight" in report.dropped and "midlayer.mlp.up_proj.weight" in report.dropped
    # EAGLE-3 ids name layer inputs (hidden_states[j]): id j is the output of layer j - 1
    assert head.aux.ids == (1, 5, 9) and head.aux.convention == "input"
    assert head.aux_layer_ids == (0, 4, 8)


def test_queries_and_keys_match_a_hand_computation(tmp_path):
    t = write_checkpoint(tmp_path)
    head, _ = load_eagle3_head(tmp_path)
    ids = torch.tensor([[3, 7, 11]])
    aux = torch.randn(1, 3, 3 * H)
    pos = torch.tensor([[5, 6, 7]])
    q, k = head(ids, aux, pos)

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    x = torch.cat([norm(t["embed_tokens.weight"][ids[0]], t["midlayer.input_layernorm.weight"]),
                   norm(aux[0] @ t["fc.weight"].T, t["midlayer.hidden_norm.weight"])], -1)
    k_ref = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(3, KV, D).transpose(0, 1)
    # rotate position p by angle p * theta^(-2i/D), rotate-half convention
    inv = 10000.0 ** (-torch.arange(0, D, 2).float() / D)
    ang = pos[0].float()[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rot = torch.cat([-k_ref[..., D // 2:], k_ref[..., : D // 2]], -1)
    torch.testing.assert_close(k[0], k_ref * cos + rot * sin, atol=1e-5, rtol=1e-5)
    assert q.shape == (1, HEADS, 3, D)


def test_paper_scale_pruning_fraction_is_computed_from_real_sizes(tmp_path):
    write_checkpoint(tmp_path)
    _, report = load_eagle3_head(tmp_path)
    assert 0 < report.pruned_fraction < 1
    assert report.pruned_fraction == pytest.approx(1 - report.kept / report.total)


@pytest.mark.parametrize("missing", ["fc.weight", "midlayer.self_attn.k_proj.weight", "midlayer.hidden_norm.weight"])
def test_missing_tensor_is_named(tmp_path, missing):
    write_checkpoint(tmp_path, drop=missing)
    with pytest.raises(ValueError, match=missing.replace(".", r"\.")):
        load_eagle3_head(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    write_checkpoint(tmp_path, reshape="midlayer.self_attn.q_proj.weight")
    with pytest.raises(ValueError, match=r"q_proj\.weight has shape"):
        load_eagle3_head(tmp_path)


def test_no_embedding_needs_the_target_one(tmp_path):
    write_checkpoint(tmp_path, embed=False)
    with pytest.raises(ValueError, match="target_embedding"):
        load_eagle3_head(tmp_path)
    head, _ = load_eagle3_head(tmp_path, target_embedding=torch.randn(VOCAB, H))
    assert head.embedding.shape == (VOCAB, H)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="config.json is missing"):
        load_eagle3_head(tmp_path)


def _with_rope_scaling(folder, rope_scaling):
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = rope_scaling
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("scaling,expected", [
    ({"rope_type": "linear", "factor": 4.0}, lambda p: p / 4),
    ({"rope_type": "dynamic", "original_max_position_embeddings": 8}, lambda p: p * 8 / (p.max() + 1)),
    ({"rope_type": "dynamic", "original_max_position_embeddings": 64}, lambda p: p),
    ({"rope_type": "default"}, lambda p: p),
])
def test_rope_scaling_rotates_at_the_scaled_positions(tmp_path, scaling, expected):
    from specontext_compile.runtime.eagle3 import _rotate

    write_checkpoint(tmp_path)
    plain, _ = load_eagle3_head(tmp_path)
    _with_rope_scaling(tmp_path, scaling)
    scaled, _ = load_eagle3_head(tmp_path)
    ids, aux, pos = torch.tensor([[3, 7, 11, 2]]), torch.randn(1, 4, 3 * H), torch.tensor([[0, 5, 9, 15]])
    q, k = scaled(ids, aux, pos)
    # at position 0 RoPE is the identity: rotate those to the positions the scaling should give
    q0, k0 = plain(ids, aux, torch.zeros_like(pos))
    torch.testing.assert_close(k, _rotate(k0, expected(pos.float()), 10000.0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q, _rotate(q0, expected(pos.float()), 10000.0), atol=1e-5, rtol=1e-5)


def test_rope_none_is_position_free(tmp_path):
    write_checkpoint(tmp_path)
    _with_rope_scaling(tmp_path, {"rope_type": "none"})
    head, _ = load_eagle3_head(tmp_path)
    ids, aux = torch.tensor([[3, 7, 11]]), torch.randn(1, 3, 3 * H)
    for a, b in zip(head(ids, aux, torch.tensor([[0, 1, 2]])), head(ids, aux, torch.tensor([[100, 4000, 9000]]))):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("scaling,match", [
    ({"rope_type": "yarn", "factor": 4.0}, "rope_type"),
    ({"rope_type": "linear", "factor": 0.5}, "factor"),
    ({"rope_type": "linear"}, "factor"),
    ({"rope_type": "dynamic"}, "original_max_position_embeddings"),
    ("linear", "dict"),
])
def test_bad_rope_scaling_is_named(tmp_path, scaling, match):
    write_checkpoint(tmp_path)
    _with_rope_scaling(tmp_path, scaling)
    with pytest.raises(ValueError, match=match):
        load_eagle3_head(tmp_path)


# --- auxiliary layer ids of imported EAGLE-3 checkpoints, on the backend -------------------
# Target: a 10-layer tiny Llama (hidden 96, 6 query / 2 KV heads). Head: a random EAGLE-3
# draft with a narrower hidden size (48, own embedding), written without specontext fields
# unless a test adds them. Convention under test: id j = the input of decoder layer j
# (Hugging Face hidden_states[j]), id L = the last layer's output before the final norm.

TARGET_LAYERS = 10


def write_eagle3_head(folder, target_hidden, ids, extra=None, vocab=128, hidden=48):
    gen = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen) * 0.2
    tensors = {
        "fc.weight": r(hidden, 3 * target_hidden), "embed_tokens.weight": r(vocab, hidden),
        "midlayer.input_layernorm.weight": 1 + r(hidden), "midlayer.hidden_norm.weight": 1 + r(hidden),
        "midlayer.self_attn.q_proj.weight": r(3 * 16, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": r(1 * 16, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": r(16, 2 * hidden), "lm_head.weight": r(32, hidden),
        "d2t": torch.zeros(32, dtype=torch.long), "t2d": torch.zeros(vocab, dtype=torch.bool),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden, "num_attention_heads": 3,
              "num_key_value_heads": 1, "head_dim": 16, "vocab_size": vocab, "draft_vocab_size": 32,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_hidden_layers": 1, **(extra or {})}
    if ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(ids)  # top level, as some exporters write it
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _target(layers=TARGET_LAYERS):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _tiny import tiny_llama

    return tiny_llama(layers=layers)


def _run(model, folder, prompt, decode_steps, budget, max_cache_len=64):
    """Compiled prefill + greedy decode through the backend; returns (cache, tokens fed,
    aux_state after the prefill)."""
    import specontext_compile as sc

    compiled = torch.compile(model.forward, backend="specontext",
                             options={"retrieval_head": str(folder), "budget": budget, "inner": "eager",
                                      "sink_tokens": 2, "recent_window": 2})
    cache = sc.SpeContextCache(model.config, max_cache_len=max_cache_len, retrieval_head=str(folder))
    tokens = [prompt]
    with torch.no_grad():
        logits = compiled(input_ids=prompt, cache=cache, use_cache=True).logits
        after_prefill = cache.draft.aux_state[:, :1].clone()  # row 0: the last token's
        for _ in range(decode_steps):
            tokens.append(logits[:, -1:].argmax(-1))
            logits = compiled(input_ids=tokens[-1], cache=cache, use_cache=True).logits
    return cache, torch.cat(tokens, 1), after_prefill


def _eager_states(model, ids):
    """Hugging Face hidden_states (``[L + 1]`` of ``[1, T, hidden]``) and the last decoder
    layer's own output (before the final norm)."""
    seen = []
    hook = model.model.layers[-1].register_forward_hook(
        lambda mod, args, out: seen.append(out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            hs = model(ids, output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return hs, seen[0]


def _decode_reports():
    from specontext_compile.backend import compile_reports

    return [r for r in compile_reports() if r.result.phase == "decode"]


def test_no_aux_ids_loads_with_the_eagle3_default_layers(tmp_path):
    from specontext_compile.runtime.draft_retrieval import head_spec

    import specontext_compile as sc

    model = _target()
    folder = write_eagle3_head(tmp_path / "h", model.config.hidden_size, None)
    assert sc.SpeContextConfig(retrieval_head=str(folder)).retrieval_head == str(folder.resolve())
    spec = head_spec(folder)
    assert spec.variant == "fused" and spec.aux.is_default and spec.aux_layer_ids == ()
    # default ids (2, L//2, L-3) = (2, 5, 7) at the input of those layers = outputs of 1, 4, 6
    assert spec.aux_layers_for(TARGET_LAYERS) == (1, 4, 6)
    assert spec.aux_layers_for(32) == (1, 15, 28)
    head, _ = load_eagle3_head(folder, num_layers=TARGET_LAYERS)
    assert head.aux_layer_ids == (1, 4, 6)
    assert load_eagle3_head(folder)[0].aux_layer_ids == ()  # unknown until the target is

    prompt = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(21))
    cache, _, fed = _run(model, folder, prompt, decode_steps=2, budget=8)
    hs, _ = _eager_states(model, prompt)
    expected = torch.cat([hs[j][:, -1:] for j in (2, 5, 7)], -1)
    assert (fed - expected).abs().max().item() < 1e-4
    decode = _decode_reports()
    assert decode and all(r.sites_rewritten == r.sites_total == TARGET_LAYERS for r in decode)
    counts = cache.path_counts()
    assert counts["decode_steps"] == 2 and counts["sparse_sites"] == 2 * TARGET_LAYERS
    assert counts["gather_sites"] == 2 * TARGET_LAYERS and counts["dense_store_sites"] == 0


@pytest.mark.parametrize("ids", [(6, 1, 3), (3, 9, 4)])
def test_aux_id_j_feeds_hidden_states_j_the_input_of_layer_j(tmp_path, ids):
    model = _target()
    folder = write_eagle3_head(tmp_path / "h", model.config.hidden_size, ids)
    prompt = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(22))
    # budget 32 covers all 21 tokens of the decode step (gathered, exact): the recorded state
    # after it is the dense model's too
    cache, tokens, fed = _run(model, folder, prompt, decode_steps=1, budget=32)
    hs, _ = _eager_states(model, prompt)
    inputs = torch.cat([hs[j][:, -1:] for j in ids], -1)
    outputs = torch.cat([hs[j + 1][:, -1:] for j in ids], -1)
    assert (fed - inputs).abs().max().item() < 1e-4
    assert (fed - outputs).abs().max().item() > 1e-2  # the two conventions are told apart here
    hs_all, _ = _eager_states(model, tokens)
    after_decode = torch.cat([hs_all[j][:, -1:] for j in ids], -1)
    assert (cache.draft.aux_state[:, :1] - after_decode).abs().max().item() < 1e-4
    # the head's keys of the prompt were computed from the previous token's hidden_states[j]
    head, _ = load_eagle3_head(folder)
    aux = torch.cat([hs[j] for j in ids], -1)
    aux = torch.cat([torch.zeros_like(aux[:, :1]), aux[:, :-1]], 1)
    _, k = head(prompt, aux, torch.arange(prompt.shape[1])[None])
    torch.testing.assert_close(cache.draft.keys[:, :, :20], k, atol=1e-4, rtol=1e-4)
    assert [(r.sites_total, r.sites_rewritten) for r in _decode_reports()] == [(TARGET_LAYERS, TARGET_LAYERS)]


def test_aux_id_equal_to_the_layer_count_is_the_last_layer_output(tmp_path):
    model = _target()
    folder = write_eagle3_head(tmp_path / "h", model.config.hidden_size, (2, 5, TARGET_LAYERS))
    prompt = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(23))
    cache, _, fed = _run(model, folder, prompt, decode_steps=3, budget=8)
    hs, last_layer = _eager_states(model, prompt)
    expected = torch.cat([hs[2][:, -1:], hs[5][:, -1:], last_layer[:, -1:]], -1)
    assert (fed - expected).abs().max().item() < 1e-4
    # Hugging Face's hidden_states[L] is that state after the final norm: not what is fed
    assert (hs[TARGET_LAYERS][:, -1:] - last_layer[:, -1:]).abs().max().item() > 1e-2
    decode = _decode_reports()
    assert [(r.sites_total, r.sites_rewritten) for r in decode] == [(TARGET_LAYERS, TARGET_LAYERS)]
    assert not decode[0].result.fallbacks()
    counts = cache.path_counts()
    assert counts["decode_steps"] == 3 and counts["sparse_sites"] == 3 * TARGET_LAYERS
    assert counts["gather_sites"] == 3 * TARGET_LAYERS
    graph = decode[0].graph_module.graph  # the draft head selected (once per step), not the lagged query
    selections = [n for n in graph.nodes if is_op(n, scorers.head_select)]
    assert [n.args[0] for n in selections] == ["draft"]


@pytest.mark.parametrize("ids,layers,match", [
    ((2, 5, TARGET_LAYERS + 1), TARGET_LAYERS, r"auxiliary ids \[11\] are outside 1\.\.10"),
    (None, 3, r"at least 4 decoder layers, this one has 3"),
])
def test_ids_the_target_cannot_give_leave_sites_dense_with_the_reason(tmp_path, ids, layers, match):
    import re

    model = _target(layers)
    folder = write_eagle3_head(tmp_path / "h", model.config.hidden_size, ids)
    prompt = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(24))
    cache, _, _ = _run(model, folder, prompt, decode_steps=1, budget=8)
    decode = _decode_reports()
    assert decode and decode[0].sites_rewritten == 0
    assert all(re.search(match, reason) for _, reason in decode[0].result.fallbacks())
    assert cache.path_counts()["sparse_sites"] == 0


def test_bad_aux_ids_are_value_errors_naming_the_fix(tmp_path):
    import specontext_compile as sc

    zero = write_eagle3_head(tmp_path / "zero", 96, (0, 3, 5))
    with pytest.raises(ValueError, match=r"id 0, the token embeddings.*use ids 1\.\.L"):
        sc.SpeContextConfig(retrieval_head=str(zero))
    with pytest.raises(ValueError, match="id 0"):
        load_eagle3_head(zero)
    negative = write_eagle3_head(tmp_path / "neg", 96, (-1, 3, 5))
    with pytest.raises(ValueError, match="list of layer ids >= 0"):
        sc.SpeContextConfig(retrieval_head=str(negative))
    marker = write_eagle3_head(tmp_path / "marker", 96, (1, 3, 5), extra={"specontext_aux_convention": "after"})
    with pytest.raises(ValueError, match=r"specontext_aux_convention must be one of \('input', 'output'\)"):
        sc.SpeContextConfig(retrieval_head=str(marker))


def test_specontext_heads_keep_their_output_convention_and_new_ones_are_marked(tmp_path):
    from specontext_compile.runtime import distill as D
    from specontext_compile.runtime import heads
    from specontext_compile.runtime.draft_retrieval import head_spec

    # written before the convention field: specontext_variant, ids = layer outputs
    legacy = write_eagle3_head(tmp_path / "legacy", 96, (0, 4, 9), extra={"specontext_variant": "fused"})
    assert head_spec(legacy).aux.convention == "output" and head_spec(legacy).aux_layer_ids == (0, 4, 9)
    assert head_spec(legacy).aux_layers_for(TARGET_LAYERS) == (0, 4, 9)
    with pytest.raises(ValueError, match=r"auxiliary ids \[9\] are outside 0\.\.8"):
        head_spec(legacy).aux_layers_for(9)
    # the shipped fused head reads the outputs of the layers it was trained on, as before
    shipped = json.loads((heads.path_of("smollm2-135m-fused") / "config.json").read_text())
    assert head_spec("smollm2-135m-fused").aux_layer_ids == tuple(shipped["specontext_training"]["aux_layers"])
    assert head_spec("smollm2-135m-fused").aux_layer_ids == (2, 15, 28)
    # distill now writes EAGLE-3 ids (output of layer j = id j + 1) and marks them
    model = _target(4)
    cfg = D.DistillConfig(variant="fused", chunk_tokens=40, query_rows=8, init_layer=1, aux_layers=(0, 3, 2),
                          steps=1)
    _, head_config = D._initial_tensors(model, cfg)
    assert head_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 4, 3]
    assert head_config["specontext_aux_convention"] == "input"
    tensors, _ = D._initial_tensors(model, cfg)
    tensors["embed_tokens.weight"] = model.model.embed_tokens.weight.detach()
    D.save_head(D.Eagle3RetrievalHead(head_config, tensors), head_config, tmp_path / "new", {})
    assert head_spec(tmp_path / "new").aux_layer_ids == (0, 3, 2)  # id 4 = L: the last layer's output
    assert head_spec(tmp_path / "new").aux_layers_for(4) == (0, 3, 2)
