"""Distilling a retrieval head on a tiny random Llama: teacher targets, training, round trip."""

import pytest
import torch

from specontext_compile.runtime import distill as D
from specontext_compile.runtime.eagle3 import load_eagle3_head
from _tiny import tiny_llama


def config(variant="fused", steps=30):
    return D.DistillConfig(variant=variant, chunk_tokens=40, query_rows=8, init_layer=1,
                           aux_layers=(0, 1, 1), steps=steps, lr=1e-2)


def test_teacher_rows_are_causal_distributions():
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    batch = D.teacher_batch(model, ids, config())
    kv = model.config.num_key_value_heads
    assert batch.teacher.shape == (kv, 8, 40)
    torch.testing.assert_close(batch.teacher.sum(-1), torch.ones(kv, 8))
    for r in range(8):  # row r is query position 32 + r: nothing after it
        assert batch.teacher[:, r, 33 + r :].abs().sum() == 0
    assert batch.aux_hidden.shape == (1, 40, 3 * model.config.hidden_size)
    assert batch.aux_hidden[0, 0].abs().max() == 0  # previous-token states: none for token 0


@pytest.mark.parametrize("variant", ["fused", "embedding"])
def test_training_lowers_the_loss_and_round_trips(tmp_path, variant):
    model = tiny_llama(layers=2)
    gen = torch.Generator().manual_seed(1)
    cfg = config(variant, steps=40)
    batches = [D.teacher_batch(model, torch.randint(0, 128, (1, 40), generator=gen), cfg) for _ in range(3)]
    head, head_config, losses = D.train_head(model, batches, cfg)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    D.save_head(head, head_config, tmp_path, {"steps": 40})
    loaded, report = load_eagle3_head(tmp_path, target_embedding=model.model.embed_tokens.weight.detach())
    ids, aux = batches[0].input_ids, batches[0].aux_hidden
    if variant == "embedding":
        aux = torch.zeros_like(aux)
    pos = torch.arange(40)[None]
    for a, b in zip(loaded(ids, aux, pos), head(ids, aux, pos)):
        torch.testing.assert_close(a, b)
    assert report.dropped == ()


def test_bad_distill_config():
    with pytest.raises(ValueError, match="variant"):
        D.DistillConfig(variant="both")
    with pytest.raises(ValueError, match="chunk_tokens"):
        D.DistillConfig(chunk_tokens=8, query_rows=8)


@pytest.mark.parametrize("scheme", ["random", "random_span"])
def test_random_positions_keep_order_and_span_the_range(scheme):
    cfg = D.DistillConfig(chunk_tokens=40, query_rows=8, positions=scheme, max_position=400)
    gen = torch.Generator().manual_seed(0)
    spans = []
    for _ in range(20):
        pos = D.training_positions(40, cfg, gen)
        assert pos.shape == (1, 40) and pos.dtype == torch.int64
        assert bool((pos[0, 1:] > pos[0, :-1]).all())  # strictly increasing: order kept
        assert 0 <= int(pos.min()) and int(pos.max()) < 400
        spans.append(int(pos[0, -1] - pos[0, 0]))
    assert max(spans) > 300  # relative distances well past the chunk length
    torch.testing.assert_close(D.training_positions(40, D.DistillConfig(chunk_tokens=40, query_rows=8), gen),
                               torch.arange(40)[None])


def test_loss_leaves_out_sinks_and_window():
    cfg = D.DistillConfig(chunk_tokens=40, query_rows=8, loss_sink=2, loss_window=5)
    excluded = D._excluded(40, 8, cfg)
    for r in range(8):  # row r is query position 32 + r
        ranked = (~excluded[r]).nonzero().flatten().tolist()
        assert ranked == list(range(2, 32 + r - 5))


@pytest.mark.parametrize("positions,rope,factor", [
    ("random", "default", 1.0), ("random_span", "default", 1.0), ("contiguous", "linear", 4.0), ("contiguous", "dynamic", 1.0),
    ("contiguous", "none", 1.0), ("random", "none", 1.0),
])
def test_length_options_round_trip(tmp_path, positions, rope, factor):
    model = tiny_llama(layers=2)
    gen = torch.Generator().manual_seed(2)
    cfg = D.DistillConfig(variant="fused", chunk_tokens=40, query_rows=8, init_layer=1, aux_layers=(0, 1, 1),
                          steps=6, lr=1e-2, positions=positions, max_position=160, rope=rope,
                          rope_factor=factor, loss_sink=1, loss_window=4)
    batches = [D.teacher_batch(model, torch.randint(0, 128, (1, 40), generator=gen), cfg) for _ in range(2)]
    head, head_config, losses = D.train_head(model, batches, cfg)
    assert all(torch.isfinite(torch.tensor(losses)))
    D.save_head(head, head_config, tmp_path, {"steps": 6})
    loaded, _ = load_eagle3_head(tmp_path, target_embedding=model.model.embed_tokens.weight.detach())
    assert loaded.rope_scaling == cfg.rope_scaling
    ids, aux = batches[0].input_ids, batches[0].aux_hidden
    pos = torch.arange(100, 140)[None]  # past the training chunk: scaling must still agree
    for a, b in zip(loaded(ids, aux, pos), head(ids, aux, pos)):
        torch.testing.assert_close(a, b)


def test_distill_records_the_length_options(tmp_path):
    import json

    class Tok:
        def __call__(self, text, return_tensors):
            return type("Enc", (), {"input_ids": torch.tensor([[ord(c) % 128 for c in text]])})

    model = tiny_llama(layers=2)
    cfg = D.DistillConfig(chunk_tokens=40, query_rows=8, init_layer=1, aux_layers=(0, 1, 1), steps=2,
                          positions="random", max_position=320, rope="linear", rope_factor=2.0, max_chunks=3)
    meta = D.distill(model, Tok(), ["a" * 90, "b" * 50], cfg, tmp_path)
    assert meta["chunks"] == 3 and meta["positions"] == "random" and meta["max_position"] == 320
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert written["specontext_training"]["rope_scaling"] == written["rope_scaling"]


def test_chunks_are_taken_round_robin():
    class Tok:
        def __call__(self, text, return_tensors):
            return type("Enc", (), {"input_ids": torch.tensor([[int(c) for c in text]])})

    chunks = D.chunks_from_texts(Tok(), ["1" * 12, "2" * 4, "3" * 8], 4, 5)
    assert [int(c[0, 0]) for c in chunks] == [1, 2, 3, 1, 3]


@pytest.mark.parametrize("kwargs,match", [
    ({"positions": "shuffled"}, "positions"),
    ({"positions": "random", "max_position": 100}, "max_position"),
    ({"rope": "yarn"}, "rope must be"),
    ({"rope": "linear", "rope_factor": 0.5}, "rope_factor"),
    ({"rope": "default", "rope_factor": 2.0}, "rope_factor"),
    ({"loss_sink": -1}, "loss_sink"),
    ({"loss_sink": 100, "loss_window": 620}, "first query row"),
    ({"max_chunks": 0}, "max_chunks"),
])
def test_bad_length_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        D.DistillConfig(chunk_tokens=768, query_rows=48, **kwargs)


def test_teacher_cache_is_reused_only_when_it_matches(tmp_path, monkeypatch):
    class Tok:
        def __call__(self, text, return_tensors):
            return type("Enc", (), {"input_ids": torch.tensor([[ord(c) % 128 for c in text]])})

    model = tiny_llama(layers=2)
    cfg = D.DistillConfig(chunk_tokens=40, query_rows=8, init_layer=1, aux_layers=(0, 1, 1), steps=2,
                          max_chunks=2)
    cache = tmp_path / "teacher.pt"
    first = D.distill(model, Tok(), ["abc" * 30], cfg, tmp_path / "a", teacher_cache=cache)
    assert cache.is_file()
    calls = []
    real = D.teacher_batch
    monkeypatch.setattr(D, "teacher_batch", lambda *a: calls.append(1) or real(*a))
    again = D.distill(model, Tok(), ["abc" * 30], cfg, tmp_path / "b", teacher_cache=cache)
    assert calls == [] and again["loss_first"] == pytest.approx(first["loss_first"])
    D.distill(model, Tok(), ["xyz" * 30], cfg, tmp_path / "c", teacher_cache=cache)
    assert len(calls) == 2  # other text: recomputed
