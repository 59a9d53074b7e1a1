"""EAGLE-3 import and pruning, on a small checkpoint written in that layout by the test."""

import json

import pytest
import torch
from safetensors.torch import save_file
from specontext_compile.runtime.eagle3 import load_eagle3_head

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
    assert head.aux_layer_ids == (1, 5, 9)


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
    from specontext_compile.runtime.eagle3 import Eagle3RetrievalHead, _rotate

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
