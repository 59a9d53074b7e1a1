"""Smoke tests of the benchmark scripts (tiny random models, CPU, well under a minute)."""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks/ package
from benchmarks import decode, gpu_end_to_end  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny shapes: one intra-op thread is faster and steadier on a loaded machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_decode_quick_on_tiny_model_writes_sane_json(tmp_path):
    out = tmp_path / "bench.json"
    rc = decode.main(["--model", "tiny", "--quick", "--contexts", "1200", "--batches", "1", "2",
                      "--contenders", "hf-eager", "own-dense", "specontext-256", "--steps", "3", "--warmup", "0",
                      "--json", str(out), "--no-plots", "--no-progress"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["complete"] is True
    for key in ("command", "machine", "copy_bandwidth_bytes_per_s", "rows", "ratios", "notes"):
        assert key in result
    assert result["copy_bandwidth_bytes_per_s"] > 1e8
    rows = result["rows"]
    assert {(r["batch"], r["contender"]) for r in rows} == {
        (b, name) for b in (1, 2) for name in ("hf-eager", "own-dense", "specontext-256")}
    for r in rows:
        for key in ("ms_median", "ms_p10", "ms_p90", "tokens_per_s", "floor_ms", "kv_bytes",
                    "peak_rss_bytes", "first_step_s", "x_floor"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["steps"] == 3 and r["context"] == 1200
        assert r["ms_min"] <= r["ms_median"] <= r["ms_max"]
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 1000 / r["ms_median"])
        assert r["speedup_vs_hf_eager"] > 0
    sparse = [r for r in rows if r["contender"] == "specontext-256"]
    assert all(r["sites_rewritten"] == "4/4" for r in sparse)
    assert all(r["speedup_vs_own_dense"] > 0 for r in rows)
    own = {r["batch"]: r for r in rows if r["contender"] == "own-dense"}
    assert all(r["sites_rewritten"] == "4/4" for r in own.values())  # every site: dense over the store
    # the sparse step reads fewer KV bytes than the dense one at the same shape
    dense = {r["batch"]: r for r in rows if r["contender"] == "hf-eager"}
    assert all(r["floor_kv_bytes"] < dense[r["batch"]]["floor_kv_bytes"] for r in sparse)
    assert all(own[b]["floor_kv_bytes"] == dense[b]["floor_kv_bytes"] for b in (1, 2))
    # KV held grows with the batch
    assert dense[2]["kv_bytes"] > dense[1]["kv_bytes"]
    key = "random/fp32/ctx=1200/batch=1"  # ratios are kept per weights, dtype, context and batch
    assert all(r["dtype"] == "fp32" for r in rows)
    assert result["ratios"][key]["hf-eager"]["hf-eager"] == pytest.approx(1.0)


def test_decode_rejects_unknown_contender():
    with pytest.raises(ValueError, match="unknown contender"):
        decode.main(["--model", "tiny", "--quick", "--contenders", "vllm"])


@pytest.mark.slow
def test_gpu_script_dry_run(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    rc = gpu_end_to_end.main(["--dry-run", "--workloads", "32:96", "--batches", "2",
                              "--window", "2", "--warmup", "0",
                              "--contenders", "sdpa", "specontext", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith("| 126 | 2 | specontext |")  # the table comes last (KV 32 + 96 - 2)
    result = json.loads(out.read_text())
    assert result["dry_run"] is True
    rows = result["rows"]
    assert [r["contender"] for r in rows] == ["sdpa", "specontext"]
    for r in rows:
        assert "note" not in r, r
        assert r["ms_median"] > 0 and r["tokens_per_s"] > 0 and r["kv_bytes"] > 0
        assert r["context"] == 32 + 96 - result["window"]
    assert all(r["sites_rewritten"] == "2/2" for r in rows if r["contender"] == "specontext")


def test_gpu_script_shapes_and_floor_bytes():
    """``--shapes`` gives the timing order; the floor's KV bytes of the Llama-3-8B shape at 128K,
    batch 1, 8 layers, bf16 (2048 bytes per token per layer for K or V):
    dense reads every key and value; specontext its 2 retrieval layers' keys, and per layer the
    page bounds (2 per 16 keys), 3 x 2048 candidate keys and 2048 kept keys and values."""
    from transformers import LlamaConfig

    args = gpu_end_to_end.parse_args(["--shapes", "130032:1", "32752:8", "--layers", "8"])
    assert args.cases == [(None, None, 130032, 1), (None, None, 32752, 8)]
    config = LlamaConfig(**{**gpu_end_to_end.LLAMA3_8B, "num_hidden_layers": 8})
    assert gpu_end_to_end.retrieval_layers(args, 8) == (2, 4)  # the 32-layer default's picks below 8
    key = 8 * 128 * 2  # one token's key, all KV heads, bf16
    dense = gpu_end_to_end.kv_read_bytes(config, "sdpa", 1, 131072, 2048, 2, 2)
    assert dense == 2 * 8 * 131072 * key
    sparse = gpu_end_to_end.kv_read_bytes(config, "specontext-cudagraphs", 1, 131072, 2048, 2, 2)
    assert sparse == 2 * 131072 * key + 8 * (2 * 131072 // 16 + 3 * 2048 + 2 * 2048) * key
    for bad in (["--shapes", "0:1"], ["--shapes", "40"], ["--window", "0"], ["--warmup", "-1"],
                ["--layers", "8", "--retrieval-layers", "8"], ["--json", str(Path(__file__).parent)]):
        with pytest.raises(SystemExit):
            gpu_end_to_end.parse_args(bad)


def test_gpu_script_help():
    with pytest.raises(SystemExit) as exc:
        gpu_end_to_end.parse_args(["--help"])
    assert exc.value.code == 0


def test_floor_counts_the_retrieval_layers_and_candidates_of_each_variant():
    """KV bytes of a step at SmolLM2's shape (30 layers, 3 KV heads, head_dim 64, fp32: 768
    bytes per token per layer for K or V), 8K context, budget 1024, batch 1: every layer reads
    1024 values and the keys of its candidates; each retrieval layer reads its whole key store."""
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         hidden_size=576, head_dim=64)
    per_token = 3 * 64 * 4

    def kv(name):
        return decode.floor_bytes(name, config, 0, 8192, 1)[1]

    pages = 2 * 512  # the page rescue reads a min and a max row per 16-token page
    int8_rows = 8 * 8192 * 3 * (64 + 4)  # 8 retrieval layers' keys as int8 rows: 64 levels, a float32 scale
    stored = 8 * 8192 * per_token  # the same keys read from the stores (selection_keys="store")
    # the default: one shared selection over the int8 rows plus a page rescue of 2 x budget
    assert kv("specontext-1024") == 30 * (1024 + 2048 + pages + 1024) * per_token + int8_rows
    assert kv("specontext-k8-1024") == kv("specontext-1024")
    assert kv("specontext-ks-1024") == 30 * (1024 + 2048 + pages + 1024) * per_token + stored
    assert kv("specontext-p0-1024") == 30 * (1024 + 1024) * per_token + int8_rows
    assert kv("specontext-r5-1024") == 30 * (1024 + 2048 + pages + 1024) * per_token + 5 * 8192 * 3 * 68
    assert kv("specontext-c4-1024") == 30 * (4096 + 2048 + pages + 1024) * per_token + int8_rows
    assert kv("specontext-cinf-1024") == 30 * (8192 + 1024) * per_token + int8_rows  # every key, in place
    assert kv("specontext-c4p1k-1024") == 30 * (4096 + 1024 + pages + 1024) * per_token + int8_rows
    assert kv("specontext-p1k-1024") == 30 * (2048 + pages + 1024) * per_token + int8_rows
    assert kv("hf-eager") == 30 * 2 * 8192 * per_token
    # layer 0 kept dense: its whole K and V instead of its sparse reads
    assert kv("specontext-d0-1024") == (29 * (1024 + 2048 + pages + 1024) + 2 * 8192) * per_token + int8_rows


def test_far_context_backend_is_exact_at_full_budget_on_the_gather_path():
    """The benchmark's sparse run equals its dense run when the budget holds every token and
    the covers-context shortcut is off (so the gather path really ran: counters asserted)."""
    import torch

    from benchmarks.far_context_backend import dense_logits, sparse_logits

    model = decode.random_model(decode.tiny_config())
    prompt, fed = torch.randint(0, 100, (40,)), torch.randint(0, 100, (6,))
    forward = torch.compile(model.forward, backend="specontext",
                            options={"budget": 64, "dense_shortcut": False, "inner": "eager"})
    sparse, paths = sparse_logits(forward, model.config, prompt, fed, capacity=64)
    dense = dense_logits(model, prompt, fed)
    layers = model.config.num_hidden_layers
    assert paths["gather_sites"] == paths["sparse_sites"] == layers * fed.numel(), paths
    assert paths["dense_store_sites"] == 0, paths
    torch.testing.assert_close(sparse, dense, atol=1e-4, rtol=1e-4)
    assert torch.equal(sparse.argmax(-1), dense.argmax(-1))


def test_fidelity_backend_lost_steps_name_the_dense_near_ties():
    """The steps where the backend's greedy token differs from dense, dense's margin there,
    and how many were dense near ties: by hand on four steps."""
    import torch

    from benchmarks.fidelity_backend import _lost_steps

    ours = torch.tensor([1, 2, 3, 4])
    dense = torch.tensor([1, 5, 3, 6])
    margin = torch.tensor([2.0, 0.05, 0.01, 0.7], dtype=torch.float64)
    got = _lost_steps(ours, dense, margin)
    assert got["lost_steps"] == [1, 3] and got["lost_dense_margins"] == [0.05, 0.7]
    assert got["lost_near_ties"] == {"margin<0.1": 1, "margin<0.5": 1, "margin<1": 2}


@pytest.mark.slow
def test_compile_time_script_on_tiny_model(tmp_path):
    """benchmarks.compile_time on the tiny model: a cold and a restart row per variant, the
    regional variant split into regions that share code (fewer compiled than run), the whole
    variant none; every row ran the sparse path; the interleaved mode times both variants."""
    import json

    from benchmarks import compile_time

    out = tmp_path / "c.json"
    regional, whole = {"budget": 8}, {"budget": 8, "regional": False}
    assert compile_time.main(["--model", "tiny", "--context", "64", "--steps", "3", "--variants",
                              json.dumps(regional), json.dumps(whole), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["options"], r["run"]) for r in rows] == [
        (regional, "cold"), (regional, "restart"), (whole, "cold"), (whole, "restart")]
    for row in rows:
        assert row["path_counts"]["gather_sites"] == 3 * 4  # 3 steps x 4 layers, sparse
        if row["options"] == regional:
            assert row["regions"] > row["regions_compiled"] > 0
        else:
            assert row["regions"] == 0
    steps = tmp_path / "s.json"
    assert compile_time.main(["--model", "tiny", "--context", "64", "--steps", "10", "--interleaved",
                              "--json", str(steps)]) == 0
    assert [r["options"] for r in json.loads(steps.read_text())["rows"]] == [{}, {"regional": False}]


def _row(context, contender, ms, batch=1, dtype="fp32", weights="real"):
    return {"weights": weights, "dtype": dtype, "context": context, "batch": batch,
            "contender": contender, "ms_median": ms}


def test_crossover_interpolates_in_log_context_and_names_the_always_and_never_cases():
    rows = [_row(2048, "own-dense", 50.0), _row(2048, "specontext-1024", 100.0),   # 0.5x
            _row(8192, "own-dense", 100.0), _row(8192, "specontext-1024", 50.0),   # 2.0x
            _row(2048, "own-dense", 10.0, batch=4), _row(2048, "specontext-1024", 5.0, batch=4),
            _row(8192, "own-dense", 10.0, batch=4), _row(8192, "specontext-1024", 20.0, batch=4),
            _row(2048, "own-dense", 1.0, dtype="bf16"), _row(2048, "specontext-1024", 0.5, dtype="bf16")]
    got = {(c["batch"], c["dtype"]): c for c in decode.crossovers(rows, "specontext-1024")}
    # speed-up 0.5 at 2^11, 2.0 at 2^13: crosses 1 a third of the way, 2^(11 + 2/3)
    assert got[(1, "fp32")]["crossover_tokens"] == round(2 ** (11 + 2 / 3))
    assert got[(1, "fp32")]["speedups"] == {"2048": 0.5, "8192": 2.0}
    assert got[(4, "fp32")]["crossover_tokens"] is None and got[(4, "fp32")]["note"] == "never"
    assert got[(1, "bf16")]["note"] == "always"
    assert "crosses 1x at ~3251 tokens" in decode.format_crossovers(rows)


def test_long_generation_greedy_decode_equals_hf_generate_and_replay_agrees():
    """The harness's own greedy loop is Hugging Face's greedy generation (same tokens), and a
    teacher-forced replay of those tokens through the same dense forward agrees at every step."""
    import torch
    from transformers import DynamicCache

    from benchmarks import long_generation as lg

    model = decode.random_model(decode.tiny_config())
    prompt = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    dense = lg.decode(model.forward, DynamicCache(config=model.config), prompt, 24, progress=False)
    want = model.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, 40:]
    assert dense["chosen"].tolist() == want.tolist()
    replay = lg.decode(model.forward, DynamicCache(config=model.config), prompt, 24,
                       feed=dense["chosen"], progress=False)
    row = lg.compare(replay, dense, 40, window=8)
    assert row["agreement"] == 1.0 and row["lost_steps"] == 0
    assert [w["first_step"] for w in row["windows"]] == [1, 9, 17]
    assert [w["context_at_start"] for w in row["windows"]] == [41, 49, 57]
    assert abs(row["nll_delta"]) < 1e-9
    # a suppressed id is never chosen even where it is the argmax
    top = int(dense["argmax"][0])
    masked = lg.decode(model.forward, DynamicCache(config=model.config), prompt, 3,
                       suppress=[top], progress=False)
    assert int(masked["chosen"][0]) != top and int(masked["argmax"][0]) == top


def test_distinct_ngram_share():
    from benchmarks import long_generation as lg

    assert lg.distinct_ngram_share([1, 2, 3, 4, 5, 6]) == 1.0
    assert lg.distinct_ngram_share([7] * 10) == 1 / 7


@pytest.mark.slow
def test_long_generation_tiny_end_to_end(tmp_path):
    """The whole protocol on a tiny model: own dense agrees at every step; the default ran
    its sparse path (counters) at a budget below the context."""
    from benchmarks import long_generation as lg

    out = tmp_path / "lg.json"
    assert lg.main(["--model", "tiny", "--prompt", "96", "--generate", "40", "--window", "16",
                    "--budget", "32", "--json", str(out), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    own, ours = result["contenders"]["own-dense"], result["contenders"]["default"]
    assert own["agreement"] == 1.0 and own["decode_steps"] == 39
    assert ours["paths"]["decode_steps"] == 39 and ours["paths"]["gather_sites"] == 39 * 4
    assert len(ours["windows"]) == 3 and [w["first_step"] for w in ours["windows"]] == [1, 17, 33]
    assert result["default_vs_own_dense"]["all"] > 0


def test_long_generation_sampling_is_seeded_and_respects_top_k_and_suppress():
    import torch
    from transformers import DynamicCache

    from benchmarks import long_generation as lg

    model = decode.random_model(decode.tiny_config())
    prompt = torch.randint(3, 512, (1, 20), generator=torch.Generator().manual_seed(2))

    def run(seed, **kw):
        return lg.decode(model.forward, DynamicCache(config=model.config), prompt, 12,
                         temperature=1.0, seed=seed, progress=False, **kw)

    a, b = run(0, top_k=5), run(0, top_k=5)
    assert a["chosen"].tolist() == b["chosen"].tolist()  # same seed, same text
    assert run(1)["chosen"].tolist() != run(2)["chosen"].tolist()
    # top_k=1 is greedy; a suppressed id is never drawn
    greedy = lg.decode(model.forward, DynamicCache(config=model.config), prompt, 12, progress=False)
    assert run(3, top_k=1)["chosen"].tolist() == greedy["chosen"].tolist()
    banned = greedy["chosen"].tolist()
    assert not set(run(4, top_k=1, suppress=banned[:1])["chosen"].tolist()[:1]) & set(banned[:1])


@pytest.mark.slow
@pytest.mark.parametrize("regional", [True, False])
def test_profile_decode_splits_the_step_by_compiled_region(tmp_path, regional):
    """The profile sees one compiled graph per step, with and without regional compilation:
    since the regions are stitched as ``invoke_subgraph`` calls (issue 51, item 3) a step is
    one compiled call whose kernels include every region's (before: prologue, 4 layers and
    epilogue as 6 calls of 4 graphs on the tiny model)."""
    from benchmarks import profile_decode

    out = tmp_path / "p.json"
    assert profile_decode.main(["--model", "tiny", "--context", "300", "--budget", "64", "--steps", "2",
                                "--warmup", "1", "--options", json.dumps({"regional": regional}),
                                "--json", str(out)]) == 0
    split = json.loads(out.read_text())["regions"]
    assert split["graph_calls_per_step"] == 1 and len(split["graphs"]) == 1
    assert all(g["us_per_call"] > 0 and g["kernels"] for g in split["graphs"])
    assert 0 < split["ms_in_graphs"]


def test_serving_floors_and_memory_count_what_each_engine_reads_and_keeps():
    """``benchmarks.serving``: dense reads every request's context, ours its budget plus, with
    the page rescue, the rescued pages' keys (half a token's KV bytes each), never more than
    the context; memory per request is the request's KV and our state's share."""
    from argparse import Namespace

    from benchmarks import serving

    args = Namespace(requests=8, input=2048, output=256, budget=512, page_rescue=1024)
    per_token, weights = 100, 10_000
    context = 2048 + 128
    assert serving.floor_bytes(args, "dense", weights, per_token) == weights + 8 * per_token * context
    assert serving.floor_bytes(args, "specontext-p0", weights, per_token) == weights + 8 * per_token * 512
    assert serving.floor_bytes(args, "specontext", weights, per_token) == weights + 8 * (per_token * 512 + 50 * 1024)
    big = Namespace(**{**vars(args), "page_rescue": 10_000})  # the rescue cannot read past the context
    assert serving.floor_bytes(big, "specontext", weights, per_token) == weights + 8 * (
        per_token * 512 + 50 * (context - 512))
    memory = serving.memory(args, {"num_blocks": 10, "page_size": 64}, per_token, state=8000)
    assert memory["kv_cache_bytes"] == 64_000 and memory["kv_bytes_per_request"] == per_token * 2304
    assert memory["state_bytes_per_request"] == 1000 and memory["state_share_of_kv_cache"] == 8000 / 64_000
    assert serving.first_divergence([1, 2, 3], [1, 2, 4]) == 2 and serving.first_divergence([1, 2], [1, 2]) == 2


def test_serving_progress_prints_every_n_decode_steps_the_median_of_those_steps(capsys):
    from benchmarks import serving

    timer = serving.StepTimer("dense", every=2)
    for seconds in (0.1, 0.3, 0.5):
        timer.decode.append(seconds)
        timer.progress()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dense: 2 decode steps") and "200.0 ms" in lines[0], lines
    quiet = serving.StepTimer("dense")  # every=0: never
    quiet.decode.append(0.1)
    quiet.progress()
    assert capsys.readouterr().err == ""


def test_serving_dense_prefix_bounds_its_whole_run_from_the_steps_it_ran():
    """``--dense-output``: dense's whole run is at least its measured prefix plus one median
    early step per remaining token; the ratio ours / that bound is a lower bound on the speedup;
    a token list equal to the first tokens of ours counts as equal."""
    from argparse import Namespace

    from benchmarks import serving

    args = Namespace(requests=8, output=3072, dense_output=512)
    bound = serving.dense_whole_run_bound({"generate_batch_s": 1000.0, "median_ms": 3000.0}, args)
    assert bound["whole_run_s_lower_bound"] == 1000.0 + 2560 * 3.0
    assert bound["generated_tokens_per_s_upper_bound"] == 8 * 3072 / 8680.0
    with pytest.raises(SystemExit):  # a prefix longer than the run, or empty, is refused by argparse
        serving.main(["--output", "16", "--dense-output", "32"])
    with pytest.raises(SystemExit):
        serving.main(["--output", "16", "--dense-output", "0"])


def test_serving_solo_adds_a_later_invocations_requests_to_the_report_of_the_same_run(tmp_path):
    """``serving_solo --start``: a second invocation keeps the first's requests, replaces any it
    reruns, keeps request order and recounts; a report of another run is refused."""
    import json

    from benchmarks import serving_solo

    def request(i, equal):
        return {"request": i, "equal": equal}

    first = serving_solo.merged(None, {"commands": ["a"], "run": "r.json", "requests": [request(0, True), request(1, False)]})
    assert (first["checked"], first["requests_equal"]) == (2, 1)
    path = tmp_path / "solo.json"
    old_format = {k: v for k, v in first.items() if k != "commands"}
    path.write_text(json.dumps({**old_format, "command": "a"}))  # the first format: one command
    earlier = serving_solo._earlier(str(path), "r.json")
    both = serving_solo.merged(earlier, {"commands": ["b"], "run": "r.json", "requests": [request(2, True), request(1, True)]})
    assert [r["request"] for r in both["requests"]] == [0, 1, 2]
    assert (both["checked"], both["requests_equal"], both["commands"]) == (3, 3, ["a", "b"])
    with pytest.raises(SystemExit, match="not other.json"):
        serving_solo._earlier(str(path), "other.json")
    assert serving_solo._earlier(str(tmp_path / "absent.json"), "r.json") is None


def test_vllm_contender_names_map_to_the_plugins_options():
    """``benchmarks.vllm_serving`` contenders (used by ``vllm_fidelity`` too): each part of the
    name sets one plugin option; an unknown part is refused, naming the grammar."""
    from benchmarks.vllm_serving import contender_options

    assert contender_options("vllm-dense") is None
    assert contender_options("specontext-1024") == {"budget": 1024}
    assert contender_options("specontext-1024-rescue2048-c2-g0.9") == {
        "budget": 1024, "page_rescue": 2048, "candidates": 2.0, "min_coverage": 0.9}
    assert contender_options("specontext-1024-ks") == {"budget": 1024, "selection_keys": "store"}
    for bad in ("specontext-x", "specontext-1024-q3", "dense", "specontext-1024-k8"):
        with pytest.raises(SystemExit, match="g<min_coverage>"):
            contender_options(bad)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       spread=st.sampled_from([1e-3, 1.0, 1e3]))
def test_the_emulated_int8_store_rounds_each_row_to_255_levels_of_its_own_scale(seed, dtype, spread):
    """``kv_int8.int8_round_trip``: every entry is ``level * scale`` rounded to the dtype, with
    ``level`` the nearest integer in -127..127 of ``x / scale`` and ``scale = max |x| / 127`` its
    row's (float64 reference); so a row takes at most 255 values and stays within half a scale
    (plus the dtype's rounding) of the input; a zero row stays zero."""
    from benchmarks.kv_int8 import int8_round_trip

    x = (torch.randn(2, 3, 4, 64, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * spread)
    x = x.to(dtype)
    x[0, 0, 0] = 0
    got = int8_round_trip(x)
    wide = x.double()
    scale = (wide.abs().amax(-1, keepdim=True) / 127).float().double()  # the function's float32 scale
    ratio = torch.where(scale > 0, wide / torch.where(scale > 0, scale, 1), 0)
    levels = ratio.round().clamp(-127, 127)
    differs = got != (levels * scale).float().to(dtype)
    # only where x / scale is a float32 tie (the function divides in float32): one level apart
    assert torch.all((ratio.abs().frac() - 0.5).abs()[differs] < 1e-4), ratio[differs]
    assert all(len(row.unique()) <= 255 for row in got.reshape(-1, 64))
    # the level's value rounded to the dtype: relative eps near the result, one subnormal
    # step below the dtype's smallest normal (float16's subnormals start at 6.1e-5)
    info = torch.finfo(dtype)
    rounding = got.double().abs() * info.eps + info.smallest_normal * info.eps
    assert torch.all((got.double() - wide).abs() <= scale / 2 * (1 + 1e-6) + rounding)
    assert torch.equal(got[0, 0, 0], torch.zeros(64, dtype=dtype))


def test_the_emulated_int8_store_reaches_every_kv_write_and_only_inside_its_block():
    """Inside ``int8_kv_store()`` the cache's write (``specontext::kv_write``, whose body the
    lowering also uses) stores the int8 round trip; after the block the plain write is back."""
    from benchmarks.kv_int8 import int8_kv_store, int8_round_trip

    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(1, 3, 2, 64, generator=g), torch.randn(1, 3, 2, 64, generator=g)
    for inside in (True, False):
        store_k, store_v, length = torch.zeros(1, 3, 8, 64), torch.zeros(1, 3, 8, 64), torch.tensor(0)
        with int8_kv_store() if inside else contextlib.nullcontext():
            torch.ops.specontext.kv_write(store_k, store_v, length, key, value, [], [])
        want_k, want_v = (int8_round_trip(key), int8_round_trip(value)) if inside else (key, value)
        assert torch.equal(store_k[:, :, :2], want_k) and torch.equal(store_v[:, :, :2], want_v)
        assert int(length) == 2
        assert not inside or not torch.equal(want_k, key)  # the rounding changed something


def test_the_emulated_int8_store_reaches_the_lowered_write():
    """Lowered inside ``int8_kv_store()``, a graph's ``kv_write`` calls the rounding write (what
    inductor then compiles); lowered after the block, the plain ``aten_step.write_kv``."""
    from benchmarks.kv_int8 import int8_kv_store
    from specontext_compile.passes.lower import lower_to_aten
    from specontext_compile.runtime import aten_step
    from torch import fx

    def graph_with_write():
        graph = fx.Graph()
        k, v, n, key, value = (graph.placeholder(name) for name in ("k", "v", "n", "key", "value"))
        write = graph.call_function(torch.ops.specontext.kv_write.default, (k, v, n, key, value, []))
        graph.output(None)
        return graph, write

    plain = aten_step.write_kv
    with int8_kv_store():
        graph, write = graph_with_write()
        lower_to_aten(graph)
        assert write.target is not plain and write.target.__module__ == "benchmarks.kv_int8"
    graph, write = graph_with_write()
    lower_to_aten(graph)
    assert write.target is aten_step.write_kv


def test_the_vllm_floor_counts_the_selections_int8_keys():
    """``benchmarks.vllm_serving``'s floor: the plugin's selection reads the retrieval layers'
    int8 keys (``head_dim + 4`` bytes a token and KV head) by default, the cache's keys with
    ``-ks``; dense reads every layer's keys and values."""
    from types import SimpleNamespace

    from benchmarks.vllm_serving import RETRIEVAL_LAYERS, _floor_ms, contender_options

    config = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, hidden_size=576, num_attention_heads=9)
    requests, context, weights, bandwidth = 8, 7680, 10**8, 10**9  # 1 GB/s: ms = MB

    def floor(name, dtype_bytes):
        return _floor_ms(config, dtype_bytes, requests, context, contender_options(name), weights, bandwidth)

    for dtype_bytes in (4, 2):
        saved = requests * RETRIEVAL_LAYERS * context * 3 * (64 * dtype_bytes - 68) / 1e6
        assert floor("specontext-1024-ks", dtype_bytes) - floor("specontext-1024", dtype_bytes) == pytest.approx(saved)
    dense = floor("vllm-dense", 4)
    assert dense == pytest.approx((weights + requests * 30 * 2 * context * 3 * 64 * 4) / 1e6)
