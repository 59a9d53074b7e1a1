"""The retrieval heads shipped in the package load with SmolLM2-135M's embedding shape."""

import json
import sys
from pathlib import Path

import pytest
import torch

from specontext_compile.runtime import heads
from specontext_compile.runtime.eagle3 import load_eagle3_head

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks/ package
from benchmarks.policies import DecodeStep, DraftHead  # noqa: E402

VOCAB, HIDDEN, KV_HEADS, HEAD_DIM, LAYERS = 49152, 576, 3, 64, 30
SHIPPED = ["smollm2-135m-embedding", "smollm2-135m-fused"]


def test_the_two_variants_are_shipped():
    assert heads.available() == SHIPPED
    with pytest.raises(ValueError, match="smollm2-135m-fused"):
        heads.path_of("no-such-head")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_head_loads_with_the_target_embedding(name):
    folder = heads.path_of(name)
    assert (folder / "model.safetensors").stat().st_size < 8 * 2**20
    config = json.loads((folder / "config.json").read_text())
    assert config["specontext_variant"] == name.rsplit("-", 1)[1]
    assert "embed_tokens.weight" not in json.dumps(config)
    embedding = torch.randn(VOCAB, HIDDEN) * 0.02
    head, report = load_eagle3_head(folder, target_embedding=embedding)
    assert head.embedding.shape == (VOCAB, HIDDEN) and head.num_heads == KV_HEADS
    assert max(head.aux_layer_ids) < LAYERS
    # kept: fc + two norms + one Q and one K head per KV head; no embedding, nothing else stored
    kept = HIDDEN * 3 * HIDDEN + 2 * HIDDEN + 2 * KV_HEADS * HEAD_DIM * 2 * HIDDEN
    assert report.kept == report.total == kept and report.dropped == ()
    # (vs an EAGLE-3 draft of this width, ~61.7M parameters, that is 97.7% pruned:
    # runtime/heads/README.md)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_head_scores_a_decode_step(name):
    head, _ = heads.load(name, torch.randn(VOCAB, HIDDEN) * 0.02)
    n = 300
    ids = torch.randint(0, VOCAB, (1, n + 1), generator=torch.Generator().manual_seed(0))
    step = DecodeStep(queries=[], keys=[torch.zeros(1, KV_HEADS, n + 1, HEAD_DIM)], previous_queries=None,
                      accumulated=None, scale=HEAD_DIM**-0.5, input_ids=ids,
                      aux_hidden=torch.randn(1, n + 1, 3 * HIDDEN))
    scores = DraftHead(head, fused=name.endswith("fused")).scores(step, 0)
    assert scores.shape == (KV_HEADS, n) and bool(torch.isfinite(scores).all())
    torch.testing.assert_close(scores.sum(-1), torch.ones(KV_HEADS))


def test_head_fidelity_scores_a_distilled_head_on_a_tiny_model():
    from benchmarks import head_fidelity

    from _tiny import tiny_llama
    from specontext_compile.runtime import distill as D

    model = tiny_llama(layers=2)
    gen = torch.Generator().manual_seed(0)
    cfg = D.DistillConfig(chunk_tokens=40, query_rows=8, init_layer=1, aux_layers=(0, 1, 1), steps=3,
                          rope="linear", rope_factor=2.0)
    batch = D.teacher_batch(model, torch.randint(0, 128, (1, 40), generator=gen), cfg)
    head, _, _ = D.train_head(model, [batch], cfg)
    policies = {**head_fidelity.BASELINES, "head": DraftHead(head, fused=True)}
    policies["lagged query x5 (ours)"] = type(policies["lagged query x5 (ours)"])(layers=(0, 1))
    ids = torch.randint(0, 128, (1, 80), generator=gen)
    table = head_fidelity.evaluate(model, ids, 60, 4, [16, 32], policies, sink=2, window=4)
    assert set(table) == set(policies)
    for per in table.values():
        assert set(per) == {16, 32} and all(0.0 < r <= 1.0 + 1e-9 for r in per.values())
        assert per[32] >= per[16] - 1e-9


def test_shipped_head_names_are_accepted_as_the_retrieval_head_option():
    from specontext_compile.config import SpeContextConfig
    from specontext_compile.runtime.heads import available, path_of

    for name in available():
        assert SpeContextConfig(retrieval_head=name).retrieval_head == str(path_of(name).resolve())
    with pytest.raises(ValueError, match="smollm2-135m-fused"):  # the error lists the shipped heads
        SpeContextConfig(retrieval_head="smollm2-135m-nope")
