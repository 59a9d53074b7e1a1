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
