"""64-bit offsets: a KV store of more than 131072 tokens x a token stride of 16384 elements.

131072 * 16384 = 2**31, so any element offset computed in int32 wraps. Two checks, both with
tiny resident memory:

* the kernels' ``gather_offsets`` helper, run in a probe kernel, returns the exact int64
  offsets of positions past 2**31 elements (pure index arithmetic, nothing is loaded);
* the whole kernel reads selected tokens beyond 2**31 elements from a cache that is an
  ``as_strided`` view over an anonymous ``MAP_NORESERVE`` mapping: the ~4.3 GB of address
  space is virtual and only the pages of the selected tokens are ever touched.
"""

import mmap
import os
import signal
import subprocess
import sys

import pytest
import torch

from specontext_compile import codegen

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOKENS = 131072 + 40  # > 2**17 tokens
TOKEN_STRIDE = 16384  # elements between consecutive tokens of one head
HEAD_DIM = 32
gather_offsets = None  # placeholder for the kernels' jit helper, set by the probe test


pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py


def test_gather_offsets_helper_is_64_bit():
    import triton
    import triton.language as tl

    module = codegen.kernel_module()
    # A jit function resolves callees among its module's globals.
    globals()["gather_offsets"] = module.gather_offsets  # fills the placeholder below

    @triton.jit
    def probe(pos_ptr, out_ptr, stride_c, stride_d, N: tl.constexpr, D: tl.constexpr):
        pos = tl.load(pos_ptr + tl.arange(0, N))
        offs = gather_offsets(pos, tl.arange(0, D), stride_c, stride_d)
        tl.store(out_ptr + tl.arange(0, N)[:, None] * D + tl.arange(0, D)[None, :], offs)

    positions = torch.tensor(
        [0, 1, 131071, 131072, 131073, TOKENS - 1, 2**20, 2**23 - 1, 3, 5, 7, 11, 13, 17, 19, 23],
        dtype=torch.int64,
        device=DEVICE,
    )
    out = torch.empty(16, 16, dtype=torch.int64, device=DEVICE)
    probe[(1,)](pos_ptr=positions, out_ptr=out, stride_c=TOKEN_STRIDE, stride_d=3, N=16, D=16)
    want = positions[:, None] * TOKEN_STRIDE + torch.arange(16, device=DEVICE)[None, :] * 3
    assert int(want.max()) > 2**31 + 2**30
    assert torch.equal(out, want)


SKIP_CODE = 77  # child exit status: address space could not be mapped


def _huge_storage(elements: int) -> tuple[mmap.mmap, torch.Tensor]:
    """fp16 tensor over an anonymous mapping that reserves no memory up front."""
    flags = (
        mmap.MAP_PRIVATE
        | getattr(mmap, "MAP_ANONYMOUS", 0x20)
        | getattr(mmap, "MAP_NORESERVE", 0x4000)
    )
    try:
        buffer = mmap.mmap(-1, elements * 2, flags=flags)
    except (OSError, ValueError, OverflowError) as exc:
        print(f"cannot map {elements * 2 / 2**30:.1f} GiB of address space: {exc}")
        sys.exit(SKIP_CODE)
    return buffer, torch.frombuffer(buffer, dtype=torch.float16, count=elements)


def huge_store_case() -> None:
    """Body of the end-to-end check; runs in a child process (see the test below)."""
    num_kv, group = 2, 2
    elements = TOKENS * TOKEN_STRIDE  # ~2.15e9 elements, ~4.3 GB virtual
    buffer, flat = _huge_storage(elements)
    # [1, kv, tokens, dim] over token-major storage: head h at column 64*h of each token.
    keys = flat.as_strided((1, num_kv, TOKENS, HEAD_DIM), (0, 64, TOKEN_STRIDE, 1))
    values = flat.as_strided(
        (1, num_kv, TOKENS, HEAD_DIM), (0, 64, TOKEN_STRIDE, 1), storage_offset=HEAD_DIM
    )
    positions = [5, 131071, 131072, 131073, TOKENS - 1]
    gen = torch.Generator().manual_seed(0)
    for p in positions:  # touches only these pages
        keys[0, :, p] = torch.randn(num_kv, HEAD_DIM, generator=gen).half()
        values[0, :, p] = torch.randn(num_kv, HEAD_DIM, generator=gen).half()
    idx = torch.tensor(positions[::-1] + [-1, -1, -1], dtype=torch.int64)
    idx = idx.view(1, 1, -1).expand(1, num_kv, -1).contiguous()
    query = torch.randn(1, num_kv * group, 1, HEAD_DIM, generator=gen).half()
    vlen = torch.tensor(TOKENS)
    out = codegen.sparse_decode_attention(
        query, keys, values, idx, vlen, scale=0.3, num_splits=2, block_n=16
    )
    want = codegen.reference_sparse_decode_attention(query, keys, values, idx, vlen, scale=0.3)
    assert keys.stride(2) * positions[-1] > 2**31
    torch.testing.assert_close(out.double(), want, rtol=2e-3, atol=2e-3)
    assert float(out.abs().max()) > 0.1  # really read the written tokens
    del keys, values, flat
    buffer.close()


@pytest.mark.skipif(DEVICE != "cpu", reason="address-space trick needs host memory")
def test_kernel_reads_tokens_past_2_31_elements():
    """In a child process, so that a wrapped (int32) offset shows as a failure, not a crash."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode == SKIP_CODE:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode != -signal.SIGSEGV, (
        "kernel crashed (SIGSEGV) reading past 2**31 elements: an offset was computed in "
        f"int32 and wrapped\n{proc.stderr[-3000:]}"
    )
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}"


if __name__ == "__main__":
    huge_store_case()
