"""The backend on a CUDA device: generated Triton kernels end to end, bf16, no recompiles,
sync-free inductor steps (with and without CUDA graphs),
KV offload refused with a clear error (docs/gpu.md says why). Skipped where there is no CUDA device (CI); run
on a GPU machine with ``pytest tests/test_cuda.py`` (``scripts/gpu_check.sh`` does)."""

import pytest
import torch
from _tiny import tiny_llama
from torch._dynamo.utils import counters
from transformers import DynamicCache

import specontext_compile as sc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = "cuda"
STEPS = 20


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed)).to(CUDA)


def _decode(forward, ids, steps, cache):
    """Prefill, then teacher-forced decode of ``steps`` fixed random tokens (both runs see
    the same inputs, so an argmax tie cannot make them diverge); last-position logits of
    every call."""
    tokens = _ids(steps, 123)
    out = []
    with torch.no_grad():
        out.append(forward(input_ids=ids, cache=cache, use_cache=True).logits[:, -1].float())
        for i in range(steps):
            logits = forward(input_ids=tokens[:, i : i + 1], cache=cache, use_cache=True).logits
            out.append(logits[:, -1].float())
    return out


def _compiled(model, **options):
    """The op chain run eagerly (``lower=False``: its counters see every call) unless ``inner``
    is given."""
    options = {"inner": "eager", "lower": False, **options} if "inner" not in options else options
    return torch.compile(model.forward, backend="specontext", options=options)


# fp32: generated kernel uses IEEE fp32 dots (no tf32), so only summation order differs from
# eager SDPA: observed ~1e-6 on CPU; bf16: one bf16 rounding of the attention output per layer
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)],
                         ids=["fp32", "bf16"])
def test_full_budget_matches_eager_with_triton_kernels(dtype, tol):
    model = tiny_llama(layers=3).to(CUDA, dtype)
    ids = _ids(45, 0)
    eager = _decode(model.forward, ids, STEPS, DynamicCache(config=model.config))
    sparse = _decode(_compiled(model, budget=128, dense_shortcut=False), ids, STEPS,
                     sc.SpeContextCache(model.config, max_cache_len=128))
    for step, (a, b) in enumerate(zip(sparse, eager)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m, step=step: f"step {step}: {m}")
    assert counters["specontext"]["sparse_attention_calls"] == 3 * STEPS
    # the generated kernel is what ran (not the dense shortcut, not the torch gather path)
    assert counters["specontext"]["triton_attention_calls"] > 0
    assert counters["specontext"]["dense_prefix_calls"] == 0


def test_small_budget_triton_equals_torch_path():
    """Same selection, two kernels: the generated Triton kernel vs the torch reference."""
    model = tiny_llama(layers=3).to(CUDA)
    ids = _ids(150, 1)
    opts = dict(budget=32, sink_tokens=2, recent_window=8)
    ref = _decode(_compiled(model, kernel="torch", **opts), ids, STEPS,
                  sc.SpeContextCache(model.config, max_cache_len=200))
    torch._dynamo.reset()
    counters.clear()
    tri = _decode(_compiled(model, kernel="triton", **opts), ids, STEPS,
                  sc.SpeContextCache(model.config, max_cache_len=200))
    assert counters["specontext"]["triton_attention_calls"] > 0
    for step, (a, b) in enumerate(zip(tri, ref)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, step=step: f"step {step}: {m}")


def _decode_without_syncs(forward, ids, tokens, cache, checked: bool = True, warmup: int = 4):
    """Prefill ``ids``, then one decode step per token of ``tokens`` (``[1, steps]``); after
    ``warmup`` steps (compile, CUDA graph capture) the steps run under
    ``torch.cuda.set_sync_debug_mode("error")`` when ``checked`` (a device-to-host sync
    raises). Returns the last-position logits of each decode step."""
    out = []
    with torch.no_grad():
        forward(input_ids=ids, cache=cache, use_cache=True)
        try:
            for i in range(tokens.shape[1]):
                if checked and i == warmup:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                out.append(forward(input_ids=tokens[:, i : i + 1], cache=cache, use_cache=True).logits[:, -1].clone())
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return out


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_inductor_decode_steps_never_sync_with_the_host(mode):
    """The default compiled step (lowered ops, inductor; with CUDA graphs for
    "reduce-overhead"): decode steps after warm-up run under
    ``torch.cuda.set_sync_debug_mode("error")`` (any device-to-host sync raises), the
    step counted itself, and logits equal the eager op chain's."""
    model = tiny_llama(layers=3).to(CUDA)
    opts = dict(budget=32, sink_tokens=2, recent_window=8)
    ids, tokens = _ids(100, 4), _ids(12, 5)
    runs = {}
    for inner in ("eager", "default"):
        torch._dynamo.reset()
        extra = {"inner": "eager", "lower": False} if inner == "eager" else {"inner": "auto", "mode": mode}
        forward = torch.compile(model.forward, backend="specontext", options={**opts, **extra})
        cache = sc.SpeContextCache(model.config, max_cache_len=160)
        counters.clear()
        out = _decode_without_syncs(forward, ids, tokens, cache, checked=inner != "eager")
        runs[inner] = out, cache.path_counts()
        if inner == "default" and mode == "reduce-overhead":  # CUDA graphs really ran (2026-12-04: skipped)
            assert counters["inductor"]["cudagraph_skips"] == 0, "CUDA graphs skipped the compiled step"
    assert runs["default"][1]["decode_steps"] == 12 and runs["default"][1]["gather_sites"] == 3 * 12
    for a, b in zip(runs["default"][0], runs["eager"][0]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_compiled_decode_does_not_recompile_per_step():
    model = tiny_llama(layers=2).to(CUDA)
    forward = _compiled(model, budget=32, sink_tokens=2, recent_window=8)
    _decode(forward, _ids(80, 2), 30, sc.SpeContextCache(model.config, max_cache_len=128))
    assert counters["stats"]["unique_graphs"] <= 2


def test_offload_on_cuda_is_refused_with_a_clear_error():
    """KV offload does not run on CUDA yet (docs/gpu.md): a clear error that names the fix,
    raised before anything moves, instead of a dynamo trace failure mid-generation."""
    model = tiny_llama(layers=2).to(CUDA)
    sc.compile(model, budget=16, recent_window=4, sink_tokens=2, device_memory_bytes=1 << 20)
    with pytest.raises(NotImplementedError, match="Drop device_memory_bytes"):
        model.generate(_ids(60, 9), max_new_tokens=4, do_sample=False)


@pytest.mark.parametrize("variant", ["embedding", "fused"])
def test_draft_head_selection_on_cuda(tmp_path, variant):
    """The draft retrieval head (its own key cache, draft ops) on the device: exact with a
    budget that covers the context, and the same logits as the torch kernel at a small one."""
    from test_draft_head_backend import write_head

    model = tiny_llama(layers=3)
    folder = write_head(tmp_path / "head", model, variant=variant)
    model = model.to(CUDA)
    ids = _ids(45, 3)
    eager = _decode(model.forward, ids, STEPS, DynamicCache(config=model.config))
    # full budget with the dense shortcut off: the selection is attended to (not SDPA over the store)
    full = _decode(_compiled(model, budget=128, retrieval_head=str(folder), dense_shortcut=False), ids, STEPS,
                   sc.SpeContextCache(model.config, max_cache_len=128, retrieval_head=str(folder)))
    for step, (a, b) in enumerate(zip(full, eager)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, step=step: f"step {step}: {m}")
    assert counters["specontext"]["dense_prefix_calls"] == 0
    assert counters["specontext"]["sparse_attention_calls"] == 3 * STEPS
    assert counters["specontext"]["triton_attention_calls"] + counters["specontext"]["gather_attention_calls"] == 3 * STEPS
    runs, triton_calls = {}, {}
    for kernel in ("torch", "triton"):
        torch._dynamo.reset()
        counters.clear()
        opts = dict(budget=16, sink_tokens=2, recent_window=4, kernel=kernel, retrieval_head=str(folder))
        runs[kernel] = _decode(_compiled(model, **opts), ids, STEPS,
                               sc.SpeContextCache(model.config, max_cache_len=128, retrieval_head=str(folder)))
        triton_calls[kernel] = counters["specontext"]["triton_attention_calls"]
    assert triton_calls["torch"] == 0 and triton_calls["triton"] > 0, triton_calls  # two kernels compared
    for step, (a, b) in enumerate(zip(runs["triton"], runs["torch"])):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, step=step: f"step {step}: {m}")


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_the_default_step_calls_the_generated_kernel_inside_inductor(mode):
    """Default options (two-stage selection with the page rescue) at a small budget: the
    lowering sends every layer's decode attention to the generated kernel
    (``specontext::generated_attention``, a ``triton_op`` inductor traces through
    ``wrap_triton``; runtime/kernel_step.py), decode steps after warm-up never sync with the
    host (with CUDA graphs too), every site gathered with the rescue, and the logits equal the
    same compiled step with ``kernel="torch"`` (inductor's own gather kernels)."""
    model = tiny_llama(layers=3).to(CUDA)
    opts = dict(budget=32, sink_tokens=2, recent_window=8, mode=mode)
    ids, tokens = _ids(150, 6), _ids(12, 7)
    runs = {}
    for kernel in ("torch", "auto"):
        torch._dynamo.reset()
        counters.clear()
        forward = torch.compile(model.forward, backend="specontext", options={**opts, "kernel": kernel})
        cache = sc.SpeContextCache(model.config, max_cache_len=200)
        out = _decode_without_syncs(forward, ids, tokens, cache)
        runs[kernel] = out, cache.path_counts(), counters["specontext"]["kernel_sites_lowered"]
        if mode == "reduce-overhead":
            assert counters["inductor"]["cudagraph_skips"] == 0, "CUDA graphs skipped the compiled step"
        assert counters["specontext"]["kernel_compile_fallbacks"] == 0, (
            "inductor could not compile the generated kernel and fell back to the torch body (see the warning)")
    assert runs["torch"][2] == 0 and runs["auto"][2] >= 3, (runs["torch"][2], runs["auto"][2])
    counts = runs["auto"][1]
    assert counts["decode_steps"] == 12 and counts["gather_sites"] == counts["page_rescue_sites"] == 3 * 12, counts
    for step, (a, b) in enumerate(zip(runs["auto"][0], runs["torch"][0])):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, step=step: f"step {step}: {m}")
