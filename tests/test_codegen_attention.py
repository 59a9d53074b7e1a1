"""Property tests of the generated sparse decode attention kernel against a float64 reference.

Runs on CPU under the Triton interpreter (TRITON_INTERPRET=1, set by the module fixture below
for the duration of this module only), or on CUDA when a GPU is present. Every spec dimension
(head_dim, group, dtype, q_len, soft-cap, sliding window, value width, MLA) has its own
property, so each value is exercised; inputs follow the kernel contract and every slot the
kernel must not read is NaN, as is the output buffer before each run.
"""


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from specontext_compile.codegen.accuracy import assert_within_bound
from benchmarks.attention_cases import make_attention_case

from specontext_compile import codegen

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}


pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py


@st.composite
def case_params(draw, **fixed):
    """Kernel-contract inputs: small, odd sizes, budgets above the context, 1-token contexts."""
    p = {
        "dtype": draw(st.sampled_from(["fp32", "bf16", "fp16"])),
        "batch": draw(st.integers(1, 2)),
        "num_kv": draw(st.integers(1, 2)),
        "group": draw(st.sampled_from([1, 2, 3, 4])),
        "q_len": draw(st.sampled_from([1, 1, 2, 3])),
        "head_dim": draw(st.sampled_from([16, 64])),
        "budget": draw(st.integers(1, 40)),
        "fill": draw(st.sampled_from([1.0, 0.7, 0.3])),
        "extra_capacity": draw(st.integers(0, 3)),
        "layout": draw(st.sampled_from(["contiguous", "token_major"])),
        "logit_scale": draw(st.sampled_from([0.5, 1.0, 4.0])),
        "soft_cap": draw(st.sampled_from([None, None, 5.0, 30.0])),
        "sliding_window": draw(st.sampled_from([None, None, 1, 7, 20])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }
    p.update(fixed)
    short = draw(st.sampled_from([1, 2, 5]))
    longest = draw(st.integers(1, 40))
    lengths = [draw(st.sampled_from([longest, short, 1])) for _ in range(p["batch"])]
    lengths[0] = longest
    p["lengths"] = lengths
    p["scalar_length"] = len(set(lengths)) == 1 and draw(st.booleans())
    p["run"] = {"num_splits": draw(st.integers(1, 4)), "block_n": draw(st.sampled_from([16, 32]))}
    return p


def run_case(params: dict) -> None:
    """Build the case, run the kernel into a NaN-poisoned output, compare with float64."""
    params = dict(params)
    run = params.pop("run")
    case = make_attention_case(device=DEVICE, **params)
    shape = (*case.query.shape[:3], case.value_cache.shape[-1])
    out = torch.full(shape, float("nan"), dtype=case.query.dtype, device=DEVICE)
    got = case.run(out=out, **run)
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(got).any(), f"NaN in output for {params}"
    assert_within_bound(
        got.cpu(), case.reference().cpu(), case.value_scale, params["dtype"], context=str(params)
    )


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@settings(max_examples=8, **SETTINGS)
@given(data=st.data())
def test_head_dims(head_dim, data):
    run_case(data.draw(case_params(head_dim=head_dim)))


@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 7, 8])
@settings(max_examples=8, **SETTINGS)
@given(data=st.data())
def test_group_sizes(group, data):
    run_case(data.draw(case_params(group=group, num_kv=data.draw(st.integers(1, 2)))))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@settings(max_examples=25, **SETTINGS)
@given(data=st.data())
def test_dtypes(dtype, data):
    run_case(data.draw(case_params(dtype=dtype)))


@pytest.mark.parametrize("q_len", [1, 2, 4, 7, 16])
@settings(max_examples=6, **SETTINGS)
@given(data=st.data())
def test_query_lengths(q_len, data):
    run_case(data.draw(case_params(q_len=q_len, group=data.draw(st.sampled_from([1, 3])))))


@pytest.mark.parametrize("soft_cap,sliding_window", [(30.0, None), (None, 5), (8.0, 3)])
@settings(max_examples=10, **SETTINGS)
@given(data=st.data())
def test_soft_cap_and_window(soft_cap, sliding_window, data):
    window = sliding_window and data.draw(st.integers(1, 2 * sliding_window))
    run_case(
        data.draw(
            case_params(
                soft_cap=soft_cap,
                sliding_window=window,
                logit_scale=data.draw(st.sampled_from([1.0, 8.0])),
            )
        )
    )


@settings(max_examples=5, **SETTINGS)
@given(data=st.data())
def test_value_width_differs(data):
    run_case(data.draw(case_params(head_dim=64, head_dim_v=data.draw(st.sampled_from([16, 48])))))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@settings(max_examples=10, **SETTINGS)
@given(data=st.data())
def test_mla_layout(dtype, data):
    """MLA: key = concat(latent, rope), value = latent; one KV head and a wide group."""
    run_case(
        data.draw(
            case_params(
                dtype=dtype,
                head_dim=64,
                num_kv=1,
                rope_dim=data.draw(st.sampled_from([16, 24])),
                group=data.draw(st.sampled_from([5, 16])),
            )
        )
    )


def test_large_group_uses_several_row_tiles():
    """group * q_len = 8 * 16 = 128 rows > block_m_max=64: two row tiles per KV head."""
    spec = codegen.KernelSpec(head_dim=16, group=8, q_len=16)
    assert spec.row_tiles == 2
    run_case(
        {
            "dtype": "fp32",
            "batch": 1,
            "num_kv": 2,
            "group": 8,
            "q_len": 16,
            "head_dim": 16,
            "budget": 20,
            "lengths": [30],
            "seed": 3,
            "run": {"num_splits": 2, "block_n": 16},
        }
    )


# ---- exactness on padded rows --------------------------------------------------------------


def _exact_case(dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 32, generator=gen).to(DEVICE, dtype)
    k = torch.randn(2, 2, 10, 32, generator=gen).to(DEVICE, dtype)
    v = torch.randn(2, 2, 10, 32, generator=gen).to(DEVICE, dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_padded_rows_are_exact(dtype):
    """An all-padding row gives exact zeros; a row with one valid entry gives exactly v."""
    q, k, v = _exact_case(dtype)
    idx = torch.full((2, 2, 40), -1, dtype=torch.int64, device=DEVICE)
    idx[0, 0, 17] = 6  # one valid entry amid padding, in the second block
    idx[1, 1, 39] = 8  # one valid entry in the last slot
    out = torch.full((2, 4, 1, 32), float("nan"), dtype=dtype, device=DEVICE)
    codegen.sparse_decode_attention(
        q,
        k,
        v,
        idx,
        torch.tensor([7, 9], device=DEVICE),
        scale=0.2,
        out=out,
        num_splits=3,
        block_n=16,
    )
    assert torch.equal(out[0, 0:2, 0], v[0, 0, 6].expand(2, 32))
    assert torch.equal(out[1, 2:4, 0], v[1, 1, 8].expand(2, 32))
    assert torch.equal(out[0, 2:4], torch.zeros_like(out[0, 2:4]))  # all -1
    assert torch.equal(out[1, 0:2], torch.zeros_like(out[1, 0:2]))  # all -1


def test_rows_with_nothing_allowed_are_zero():
    """q_len=3 over a 1-token context: rows 0 and 1 may see nothing -> zeros; row 2 sees it."""
    q, k, v = _exact_case(torch.float32)
    q = q.expand(2, 4, 3, 32).contiguous()
    idx = torch.full((2, 2, 4), -1, dtype=torch.int64, device=DEVICE)
    idx[:, :, 2] = 0
    out = codegen.sparse_decode_attention(q, k, v, idx, torch.tensor(1, device=DEVICE), scale=0.2)
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    assert torch.equal(out[0, :2, 2], v[0, 0, 0].expand(2, 32))


def test_sliding_window_keeps_only_recent_tokens():
    q, k, v = _exact_case(torch.float32)
    idx = torch.arange(10, device=DEVICE).flip(0).view(1, 1, 10).expand(2, 2, 10).contiguous()
    out = codegen.sparse_decode_attention(q, k, v, idx, 10, scale=0.2, sliding_window=1)
    assert torch.equal(out[:, 0:2, 0], v[:, 0, 9].unsqueeze(1).expand(2, 2, 32))


# ---- validation ----------------------------------------------------------------------------


def _valid_inputs():
    q, k, v = _exact_case(torch.float32)
    idx = torch.tensor([[[0, 3, -1], [2, 6, 1]], [[4, -1, -1], [0, 1, 2]]], device=DEVICE)
    return q, k, v, idx, torch.tensor([7, 5], device=DEVICE)


def test_rejects_index_past_valid_length():
    q, k, v, idx, vlen = _valid_inputs()
    idx[1, 0, 0] = 5  # == valid_length[1]: that slot was never written
    with pytest.raises(ValueError, match=r"indices\[1, 0, 0\] = 5 .*valid_length\[1\] = 5"):
        codegen.sparse_decode_attention(q, k, v, idx, vlen, scale=0.1)


@pytest.mark.parametrize(
    "bad,match", [(10, r"= 10 .*capacity 10"), (-2, r"= -2 "), (3, "selected twice")]
)
def test_rejects_bad_selection(bad, match):
    q, k, v, idx, _ = _valid_inputs()
    idx[0, 1, 2] = bad  # row holds [2, 6, bad]; 3 collides with nothing, so add a duplicate
    if bad == 3:
        idx[0, 1, 0] = 3
    with pytest.raises(ValueError, match=match):
        codegen.sparse_decode_attention(q, k, v, idx, 10, scale=0.1)


def test_rejects_valid_length_beyond_capacity():
    q, k, v, idx, _ = _valid_inputs()
    with pytest.raises(ValueError, match=r"valid_length\[0\] = 11 .*capacity=10"):
        codegen.sparse_decode_attention(
            q, k, v, idx, torch.tensor([11, 4], device=DEVICE), scale=0.1
        )


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a.update(query=a["query"][:, :3]), "multiple of num_kv_heads"),
        (lambda a: a.update(indices=a["indices"].int()), "int64"),
        (lambda a: a.update(key_cache=a["key_cache"].half()), "dtype"),
        (lambda a: a.update(value_cache=a["value_cache"][:1]), "value_cache must be"),
        (lambda a: a.update(query=a["query"].expand(2, 4, 17, 32)), "q_len=17"),
        (lambda a: a.update(valid_length=torch.tensor([1, 2, 3], device=DEVICE)), "shape"),
        (
            lambda a: a.update(
                query=a["query"].double(),
                key_cache=a["key_cache"].double(),
                value_cache=a["value_cache"].double(),
            ),
            "unsupported dtype",
        ),
    ],
)
def test_rejects_bad_arguments(mutate, match):
    q, k, v, idx, vlen = _valid_inputs()
    args = {"query": q, "key_cache": k, "value_cache": v, "indices": idx, "valid_length": vlen}
    mutate(args)
    with pytest.raises(ValueError, match=match):
        codegen.sparse_decode_attention(**args, scale=0.1)


@pytest.mark.parametrize(
    "options,match",
    [
        ({"soft_cap": 0.0}, "soft_cap"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"scale": float("nan")}, "scale"),
    ],
)
def test_rejects_bad_options(options, match):
    q, k, v, idx, vlen = _valid_inputs()
    with pytest.raises(ValueError, match=match):
        codegen.sparse_decode_attention(q, k, v, idx, vlen, **{"scale": 0.1, **options})


def test_unchecked_indices_never_read_past_valid_length():
    """With check_indices=False an index >= valid_length is skipped like padding, not read."""
    q, k, v, idx, vlen = _valid_inputs()
    k[1, :, 5:] = float("nan")
    v[1, :, 5:] = float("nan")
    bad = idx.clone()
    bad[1, 0, 1] = 7  # beyond valid_length[1] = 5, inside the capacity
    got = codegen.sparse_decode_attention(q, k, v, bad, vlen, scale=0.1, check_indices=False)
    want = codegen.sparse_decode_attention(q, k, v, idx, vlen, scale=0.1)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only")
def test_cpu_tensors_without_interpreter_get_a_clear_error(monkeypatch):
    q, k, v, idx, vlen = _valid_inputs()
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1 for CPU"):
        codegen.sparse_decode_attention(q, k, v, idx, vlen, scale=0.1)
