"""The Triton kernels as a source file: specs, their constexpr specialisation, loading, CLI,
sm_90 builds (issue 53, item 3).

* a spec changes exactly the ``tl.constexpr`` arguments it should, and the launch passes
  exactly the constexpr parameters each kernel declares;
* ``codegen/kernels.py`` is loaded once per Triton mode (the same jit objects for every spec:
  Triton's own cache keys the binaries by the constexprs);
* the kernels keep the file's conventions (int64 program ids, no bare ``tl.sum``/``tl.max``);
* when triton's NVIDIA backend and ptxas are present, they build for sm_90a without a GPU and
  without register spills.
"""

import ast
import inspect
import os
import re
import subprocess
import sys

import pytest
from specontext_compile.codegen import KernelSpec, split_constexprs
from specontext_compile.codegen.__main__ import main as cli_main
from specontext_compile.codegen.launch import KERNELS_FILE, split_kernel_name

from specontext_compile import codegen

pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py

BASE = KernelSpec(head_dim=128, group=4, dtype="bf16")


@pytest.mark.parametrize(
    "change,constexprs",
    [
        ({"group": 3}, {"GROUP": 3}),
        ({"head_dim": 80}, {"HEAD_DIM": 80, "HEAD_DIM_V": 80}),
        ({"q_len": 5}, {"Q_LEN": 5, "BLOCK_M": 32}),
        ({"soft_cap": True}, {"HAS_SOFT_CAP": True}),
        ({"sliding_window": True}, {"HAS_WINDOW": True}),
        ({"dtype": "fp16"}, {}),
        ({"dtype": "fp32"}, {"DOT_IEEE": True, "BLOCK_N": 32}),
        ({"block_n": 32}, {"BLOCK_N": 32}),
        ({"head_dim_v": 64}, {"HEAD_DIM_V": 64, "BLOCK_DV": 64}),
        ({"group": 8, "q_len": 16}, {"GROUP": 8, "Q_LEN": 16, "BLOCK_M": 64, "ROW_TILES": 2}),
    ],
)
def test_constexprs_differ_where_the_spec_does(change, constexprs):
    before, after = split_constexprs(BASE), split_constexprs(BASE.replace(**change))
    changed = {k: v for k, v in after.items() if before[k] != v}
    assert changed == constexprs


def test_dot_precision_follows_dtype_and_mode():
    """fp32: exact products (no TF32 on GPU); bf16 operands upcast only under the interpreter
    (whose dot multiplies bf16 bits as integers)."""
    fp32, bf16 = BASE.replace(dtype="fp32"), BASE
    assert (split_constexprs(fp32)["DOT_IEEE"], split_constexprs(bf16)["DOT_IEEE"]) == (True, False)
    assert split_constexprs(bf16, interpreted=True)["DOT_UPCAST"] is True
    assert split_constexprs(bf16)["DOT_UPCAST"] is False
    assert split_constexprs(BASE.replace(dtype="fp16"), interpreted=True)["DOT_UPCAST"] is False


@pytest.mark.parametrize("spec", [BASE, KernelSpec(head_dim=512, rope_dim=64, group=16)], ids=["gqa", "mla"])
def test_launch_sets_exactly_the_kernels_constexpr_parameters(spec):
    import triton.language as tl

    def constexprs(kernel) -> set:
        return {p.name for p in inspect.signature(kernel.fn).parameters.values() if p.annotation is tl.constexpr}

    module = codegen.kernel_module()
    assert constexprs(getattr(module, split_kernel_name(spec))) == set(split_constexprs(spec))
    assert constexprs(module.sparse_decode_merge_kernel) == {"HEAD_DIM_V", "BLOCK_DV", "BLOCK_S"}


def test_mla_kernel_reuses_the_latent_tile_as_value():
    kernel = codegen.kernel_module().sparse_mla_split_kernel.fn
    names = set(inspect.signature(kernel).parameters)
    assert "v_ptr" not in names and {"kr_ptr", "qr_ptr"} <= names
    assert "dot_f32(p.to(k.dtype), k, DOT_IEEE, DOT_UPCAST)" in inspect.getsource(kernel)


def test_spec_is_canonical():
    assert KernelSpec(head_dim=128) == KernelSpec(head_dim=128, block_n=64)  # auto resolved
    assert hash(KernelSpec(head_dim=96, dtype="fp16")) == hash(KernelSpec(96, dtype="half"))
    assert split_constexprs(BASE) == split_constexprs(KernelSpec(128, 4, "bfloat16", 1))


def test_one_module_per_mode_and_the_same_kernels_for_every_spec(monkeypatch):
    if not codegen.interpreter_enabled():
        pytest.skip("a CUDA device: the fixture keeps the compiled mode")
    first = codegen.kernel_module()
    assert first is codegen.kernel_module()
    assert first.sparse_decode_split_kernel.__class__.__name__ == "InterpretedFunction"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    compiled = codegen.kernel_module()
    assert compiled is not first and compiled.__file__ == first.__file__ == str(KERNELS_FILE)
    from triton import JITFunction

    assert isinstance(compiled.sparse_decode_split_kernel, JITFunction)
    assert "specontext_compile.codegen.kernels_compiled" not in sys.modules  # not registered


def test_kernels_follow_the_files_conventions():
    """Every program id promoted to int64 before it meets a stride; reductions only through
    the helpers (``tl.sum``/``tl.max`` bound before TRITON_INTERPRET was set cannot run
    interpreted)."""
    text = KERNELS_FILE.read_text()
    tree = ast.parse(text)
    functions = {n.name: ast.get_source_segment(text, n) for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {name for name in functions if name.endswith("_kernel")} == {
        "sparse_decode_split_kernel", "sparse_mla_split_kernel", "sparse_decode_merge_kernel"}
    body = "\n".join(functions.values())
    casts = re.findall(r"tl\.program_id\(\d\)(\.to\(tl\.int64\))?", body)
    assert len(casts) == 6 and all(casts)
    for name, source in functions.items():
        if name not in ("sum_along", "max_along"):
            assert "tl.sum(" not in source and "tl.max(" not in source, name
    source = inspect.getsource(codegen.kernel_module().sparse_decode_split_kernel.fn)
    assert "gather_rows(k_base, pos, pos_ok, offs_d, d_ok, k_stride_c, k_stride_d)" in source


def test_spec_validation():
    with pytest.raises(ValueError, match="q_len=17"):
        KernelSpec(q_len=17)
    with pytest.raises(ValueError, match="unsupported dtype"):
        KernelSpec(dtype="fp64")
    with pytest.raises(ValueError, match="block_n=24"):
        KernelSpec(block_n=24)
    with pytest.raises(ValueError, match="head_dim_v"):
        KernelSpec(head_dim=128, rope_dim=64, head_dim_v=64)
    spec = KernelSpec(head_dim=80, group=7, q_len=3)
    assert (spec.block_d, spec.block_m, spec.rows, spec.row_tiles) == (128, 32, 21, 1)


def test_cli_show_prints_the_specialisation(capsys):
    assert cli_main(["show", "--head-dim", "80", "--group", "7", "--q-len", "3", "--soft-cap"]) == 0
    out = capsys.readouterr().out
    assert str(KERNELS_FILE) in out and "sparse_decode_split_kernel[(batch, num_kv_heads * 1, num_splits)]" in out
    assert "HEAD_DIM=80 HEAD_DIM_V=80 BLOCK_D=128" in out and "GROUP=7 Q_LEN=3" in out and "HAS_SOFT_CAP=True" in out
    assert cli_main(["show", "--head-dim", "512", "--rope-dim", "64", "--group", "16"]) == 0
    assert "sparse_mla_split_kernel" in capsys.readouterr().out
    assert cli_main(["show", "--q-len", "40"]) == 2


def test_triton_available_under_interpreter():
    assert codegen.triton_available() is True


def _nvidia_toolchain() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return os.path.exists(get_ptxas(90).path)
    except (ImportError, AttributeError, RuntimeError):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _nvidia_toolchain(), reason="triton's NVIDIA backend/ptxas not found")
@pytest.mark.parametrize("args", [
    ["--head-dim", "128", "--group", "4", "--dtype", "bf16"],
    ["--head-dim", "80", "--group", "7", "--dtype", "fp16", "--q-len", "3", "--soft-cap", "--sliding-window"],
    ["--head-dim", "512", "--rope-dim", "64", "--group", "16"],
], ids=["bf16", "fp16-cap-window", "mla"])
def test_kernels_build_for_sm90_without_spills(args):
    """AOT build for Hopper in a child process (TRITON_INTERPRET unset there)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "specontext_compile.codegen", "compile", *args], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    assert len(rows) == 2, proc.stdout
    for row in rows:
        regs, spills = int(row[2]), int(row[3])
        assert 0 < regs <= 255 and spills == 0, proc.stdout
