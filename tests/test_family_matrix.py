"""The generated family matrix (issue 14 item 5, ``tests/_family_matrix.py``;
table: ``scripts/family_table.py`` -> ``docs/families_table.md``): a few quick families
beyond the hand-listed 13 of ``tests/test_families.py``, run as the table runs them (tiny
generic config, sdpa, prompt 30 + 20 decode steps, full budget on the gather path), and the
generic config shrinking itself."""

import _family_matrix as fm
import pytest

from specontext_compile.tiny_models import FAMILIES as HAND_TUNED

# picked from docs/results/families.json: quick, and each with something of its own
QUICK = {
    "bert-generation": "an encoder family run as a causal decoder (is_decoder=True)",
    "codegen": "partial rotary (rotary_dim), fused qkv",
    "bamba": "hybrid: a Mamba layer and an attention layer",
    "gemma4_text": "sliding layer (head_dim 16) and global layer (head_dim 512, per-layer config)",
    "deepseek_v32": "multi-head latent attention with a DSA indexer",
}


# the generated table is the slow tier; gemma4_text (per-layer head sizes) runs in the fast tier
@pytest.mark.parametrize("family", [f if f == "gemma4_text" else pytest.param(f, marks=pytest.mark.slow) for f in QUICK])
def test_generic_family_is_rewritten_exact_and_gathers(family):
    assert family not in HAND_TUNED
    row = fm.run_case(family, "sdpa")
    assert row["status"] == "rewritten", row
    assert row["decode_sites"] >= 1
    assert row["decode_rewritten"] == row["decode_sites"]  # every site rewritten (none needs a reason)
    assert row["reasons"] == []
    assert row["max_abs_logit_err"] <= 1e-4 and row["exact"]
    counts = row["path_counts"]  # kept by the compiled step itself
    assert row["gather_path"] and counts["gather_sites"] == row["decode_rewritten"] * fm.DECODE_STEPS, counts
    assert counts["dense_store_sites"] == 0


@pytest.mark.parametrize("model_type", ["olmo2", "gpt_oss", "qwen3_next", "gemma3_text", "gemma3", "jamba"])
def test_tiny_config_has_two_layers_and_small_sizes(model_type):
    config = fm.tiny_config(model_type)
    text = config.get_text_config()
    assert text.num_hidden_layers == 2 and text.hidden_size == 64 and text.vocab_size == fm.VOCAB
    kinds = getattr(text, "layer_types", None)
    if model_type in ("gpt_oss", "qwen3_next", "gemma3_text"):  # a mix of layer kinds is kept
        assert len(kinds) == 2 and len(set(kinds)) == 2, kinds


def test_causal_lm_families_is_sorted_and_covers_the_hand_listed():
    families = fm.causal_lm_families()
    assert families == sorted(families) and set(HAND_TUNED) <= set(families)


def test_non_decoders_are_reported_not_raised():
    row = fm.run_case("bart")  # encoder-decoder: not a text decoder reachable with input_ids alone
    assert row["status"] == "no_model" and row["reasons"] == ["encoder-decoder model"]
