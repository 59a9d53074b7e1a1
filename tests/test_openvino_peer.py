"""The OpenVINO GenAI peer of the decode benchmark (issue 51): contender parsing, the greedy
agreement, the dense fp32 reference, the peer's JSON as a row, the missing-venv error. Only the
last test needs ``.venv-openvino`` (``bash scripts/openvino_venv.sh``); it is skipped without."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks/ package
from benchmarks import decode, openvino_peer  # noqa: E402

HAS_VENV = (decode.OPENVINO_VENV / "bin" / "python").exists() and \
    (decode.OPENVINO_MODEL / "openvino_model.xml").exists()


def test_openvino_contenders_parse_to_the_peer_configs():
    assert decode.parse_openvino("openvino-fp32") == "fp32-dense"
    assert decode.parse_openvino("openvino-default") == "default"
    assert decode.parse_openvino("openvino-evict-1024") == "evict-1024"
    for bad in ("openvino-evict-1000", "openvino-evict-128", "openvino-bf16", "openvino-evict-"):
        with pytest.raises(ValueError, match="openvino-evict-<budget>"):
            decode.parse_openvino(bad)
    names = ["hf-eager", "specontext-1024", "openvino-fp32", "openvino-evict-512"]
    assert decode.check_contenders(names) == names
    for name in ("fp32-dense", "default", "evict-1024"):  # the peer accepts what decode sends
        openvino_peer.parse_config(name)
    assert openvino_peer.parse_config("evict-1024") == 1024
    with pytest.raises(ValueError):
        openvino_peer.parse_config("evict-100")


def test_peer_properties_pin_fp32_except_for_the_defaults():
    assert openvino_peer.device_properties("default", 2) == {"INFERENCE_NUM_THREADS": 2}
    assert openvino_peer.device_properties("evict-512", 2) == {
        "INFERENCE_NUM_THREADS": 2, "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}


def test_greedy_agreement_on_a_hand_example():
    ref = [5, 6, 7, 8]
    assert decode.agreement([5, 6, 7, 8], ref) == {
        "agree_share": 1.0, "agree_first_diff": None, "agree_tokens": 4}
    assert decode.agreement([5, 9, 7, 0], ref) == {
        "agree_share": 0.5, "agree_first_diff": 1, "agree_tokens": 4}
    assert decode.agreement([5, 6, 7, 8, 1], ref, n=2)["agree_tokens"] == 2
    assert decode.agreement([], ref)["agree_share"] is None


def test_missing_venv_names_the_setup_script(tmp_path, monkeypatch, capsys):
    with pytest.raises(RuntimeError, match=r"bash scripts/openvino_venv\.sh"):
        decode.openvino_python(tmp_path / "no-venv", tmp_path / "no-model")
    monkeypatch.setattr(decode, "OPENVINO_VENV", tmp_path / "no-venv")
    with pytest.raises(SystemExit):
        decode.parse_args(["--model", "tiny", "--contenders", "openvino-fp32"])
    assert "bash scripts/openvino_venv.sh" in capsys.readouterr().err


def test_reference_tokens_are_hf_generate_greedy_tokens():
    model = decode.random_model(decode.tiny_config())
    ids = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    _, source, first = decode.prefill_source(model, ids)
    got = decode.reference_tokens(model, source, first, n=12)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              pad_token_id=0)[0, 40:].tolist()
    assert got == want


def test_peer_json_becomes_a_row_over_the_same_steps_and_its_floor_uses_its_precisions():
    peer = {"first_token_s": 2.5, "step_ms": [50.0, 9.0, 9.0, 9.0] + [10.0, 12.0, 30.0] + [99.0],
            "peak_rss_bytes": 1 << 30, "tokens": list(range(64)), "config": "default",
            "load_s": 1.0, "threads": 2, "properties": {}, "scheduler_config": None,
            "versions": {}, "openvino_step_ms": [], "openvino_ttft_s": 2.5,
            "openvino_tpot_ms": 10.0,
            "applied": {"INFERENCE_PRECISION_HINT": "bf16", "key_cache_input_type": "bf16"}}
    row = decode.openvino_result(peer, steps=3, warmup=3)
    assert row["prefill_s"] == 2.5 and row["first_step_s"] == 0.05
    assert (row["steps"], row["ms_median"], row["ms_min"], row["ms_max"]) == (3, 12.0, 10.0, 30.0)
    assert row["kv_bytes"] is None and row["tokens"] == list(range(64))
    config = decode.tiny_config()  # 4 layers, 2 KV heads of 16: 128 B per token per K or V at fp32
    assert decode.openvino_floor("openvino-default", config, 400, 1000, peer["applied"]) == (
        200, 4 * 2 * 1000 * 2 * 16 * 2)
    fp32 = {"INFERENCE_PRECISION_HINT": "f32", "key_cache_input_type": "f32"}
    assert decode.openvino_floor("openvino-evict-512", config, 400, 1000, fp32) == (
        400, 4 * 2 * 512 * 2 * 16 * 4)


@pytest.mark.slow  # loads SmolLM2 in both venvs (about 40 s)
@pytest.mark.skipif(not HAS_VENV, reason=".venv-openvino or out/openvino/smollm2-135m is missing "
                    "(bash scripts/openvino_venv.sh)")
def test_peer_runs_in_its_venv_on_given_ids_and_matches_the_fp32_reference():
    """The real peer on 96 prompt tokens: the 8 greedy tokens of Hugging Face eager fp32 on the
    same ids (same weights, same ids), fp32 as applied, step times."""
    from specontext_compile.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    ids = decode.real_text_ids(tokenizer, 96)
    _, source, first = decode.prefill_source(model, ids)
    reference = decode.reference_tokens(model, source, first, n=8)
    peer = decode.run_openvino("openvino-fp32", ids, max_new_tokens=8, warmup=1, threads=1)
    assert peer["tokens"] == reference and len(peer["step_ms"]) == 7
    assert peer["prompt_tokens"] == 96 and peer["threads"] == 1
    assert peer["applied"]["INFERENCE_PRECISION_HINT"] == "f32"
    assert peer["applied"]["key_cache_input_type"] == "f32"
