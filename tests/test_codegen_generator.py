"""The kernel generator: specs, generated source, compile-once cache, CLI, sm_90 builds.

* the source of two different specs differs exactly where the spec says it should;
* equal specs map to the same compiled kernels (same objects), different specs do not;
* every generated source parses, and (when triton's NVIDIA backend and ptxas are present)
  builds for sm_90a without a GPU and without register spills.
"""

import ast
import os
import subprocess
import sys

import pytest
from specontext_compile.codegen import KernelSpec, generated_source
from specontext_compile.codegen.__main__ import main as cli_main

from specontext_compile import codegen


@pytest.fixture(autouse=True, scope="module")
def triton_interpreter():
    """Triton interpreter for this module only (see test_codegen_attention.py)."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if previous is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = previous


def _diff(a: str, b: str) -> tuple[set, set]:
    la, lb = set(a.splitlines()), set(b.splitlines())
    return la - lb, lb - la


BASE = KernelSpec(head_dim=128, group=4, dtype="bf16")


@pytest.mark.parametrize(
    "change,only_a,only_b",
    [
        ({"group": 3}, "GROUP=4, Q_LEN=1", "GROUP=3, Q_LEN=1"),
        ({"head_dim": 80}, "HEAD_DIM=128, HEAD_DIM_V=128", "HEAD_DIM=80, HEAD_DIM_V=80"),
        ({"q_len": 5}, "GROUP=4, Q_LEN=1", "GROUP=4, Q_LEN=5"),
        ({"soft_cap": True}, "HAS_SOFT_CAP=False", "HAS_SOFT_CAP=True"),
        ({"sliding_window": True}, "HAS_WINDOW=False", "HAS_WINDOW=True"),
        ({"dtype": "fp16"}, "tl.dot(dot_in(", "out.to(tl.float16)"),
        ({"dtype": "fp32"}, "tl.dot(dot_in(", 'input_precision="ieee"'),
        ({"block_n": 32}, "BLOCK_M=16, BLOCK_N=64", "BLOCK_M=16, BLOCK_N=32"),
        ({"rope_dim": 64, "head_dim": 128}, "v_ptr=value_cache", "kr_ptr=rope_cache"),
    ],
)
def test_source_differs_where_the_spec_does(change, only_a, only_b):
    a, b = generated_source(BASE), generated_source(BASE.replace(**change))
    gone, new = _diff(a, b)
    assert any(only_a in line for line in gone), f"{only_a!r} should leave the source"
    assert any(only_b in line for line in new), f"{only_b!r} should enter the source"
    assert only_a not in b


def test_source_is_deterministic_and_equal_specs_share_it():
    assert generated_source(BASE) == generated_source(KernelSpec(128, 4, "bfloat16", 1))
    assert KernelSpec(head_dim=128) == KernelSpec(head_dim=128, block_n=64)  # auto resolved
    assert hash(KernelSpec(head_dim=96, dtype="fp16")) == hash(KernelSpec(96, dtype="half"))


def test_mla_source_reuses_the_latent_tile_as_value():
    src = generated_source(KernelSpec(head_dim=512, rope_dim=64, group=16))
    assert "v_ptr" not in src and "kr_ptr" in src
    assert "tl.dot(dot_in(p.to(k.dtype)), dot_in(k))" in src


def test_source_follows_kernel_conventions():
    src = generated_source(BASE)
    assert "tl.program_id(0).to(tl.int64)" in src  # int64 program ids
    assert "k_stride_c" in src and "q_ptr" in src  # x_ptr / x_stride_* naming
    launch = src[src.index("def launch(") :]
    call = launch[launch.index("split_kernel[(") :]
    args = call[call.index("(", call.index("]")) + 1 : call.index("\n    )")]
    assert "=" in args and all(
        "=" in part for part in args.replace("\n", " ").split(",") if part.strip()
    )  # keyword arguments only


@pytest.mark.parametrize(
    "spec",
    [
        KernelSpec(head_dim=d, group=g, dtype=t, q_len=q, soft_cap=c, sliding_window=w)
        for d, g, t, q, c, w in [
            (64, 1, "fp32", 1, False, False),
            (80, 3, "bf16", 2, True, False),
            (96, 6, "fp16", 16, False, True),
            (256, 7, "bf16", 3, True, True),
            (128, 8, "fp32", 16, True, True),
        ]
    ]
    + [KernelSpec(head_dim=512, rope_dim=64, group=16)],
)
def test_generated_source_parses(spec):
    tree = ast.parse(generated_source(spec))
    names = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert "launch" in names and "gather_offsets" in names


def test_cache_returns_the_same_compiled_kernel_for_the_same_spec():
    codegen.clear_cache()
    first = codegen.load_kernels(KernelSpec(head_dim=64, group=2, dtype="fp16"))
    again = codegen.load_kernels(
        KernelSpec(head_dim=64, group=2, dtype=__import__("torch").float16)
    )
    other = codegen.load_kernels(KernelSpec(head_dim=64, group=3, dtype="fp16"))
    assert first is again
    assert first.module.sparse_decode_split_kernel is again.module.sparse_decode_split_kernel
    assert other is not first and other.path != first.path
    assert first.path.read_text() == first.source == generated_source(first.spec)
    assert first.interpreted


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


def test_cli_show_prints_the_source(capsys):
    assert cli_main(["show", "--head-dim", "128", "--group", "4", "--dtype", "bf16"]) == 0
    assert capsys.readouterr().out == generated_source(BASE)
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
def test_kernels_build_for_sm90_without_spills():
    """AOT build for Hopper in a child process (TRITON_INTERPRET unset there)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    checks = [
        ["--head-dim", "128", "--group", "4", "--dtype", "bf16"],
        [
            "--head-dim",
            "80",
            "--group",
            "7",
            "--dtype",
            "fp16",
            "--q-len",
            "3",
            "--soft-cap",
            "--sliding-window",
        ],
        ["--kind", "retrieval", "--head-dim", "128", "--group", "4"],
    ]
    for args in checks:
        proc = subprocess.run(
            [sys.executable, "-m", "specontext_compile.codegen", "compile", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        rows = [line.split() for line in proc.stdout.splitlines()[1:]]
        assert len(rows) == 2, proc.stdout
        for row in rows:
            regs, spills = int(row[2]), int(row[3])
            assert 0 < regs <= 255 and spills == 0, proc.stdout


def test_docs_example_is_current():
    """docs/generated_kernel_example.py is `show --head-dim 128 --group 4 --dtype bf16`."""
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "docs" / "generated_kernel_example.py"
    assert example.read_text() == generated_source(BASE), (
        "regenerate: python -m specontext_compile.codegen show --head-dim 128 --group 4 "
        "--dtype bf16 > docs/generated_kernel_example.py"
    )
