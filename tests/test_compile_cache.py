"""A later process loads the compiled decode step instead of compiling it (issue 51, item 4):
every region's AOTAutograd and inductor entries hit (none bypassed: our lowered functions are
marked cacheable, keyed by the pass's sources hash), through a saved artifact file into an
empty cache folder, and the loaded step computes the same logits."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specontext_compile import compile_cache

ROOT = Path(__file__).resolve().parent.parent

# One process: compile a tiny Llama's decode step (budget below the context: the sparse path),
# run 3 decode steps; print the caches' counters and the logits. argv: "save"/"load" FILE.
CHILD = r"""
import json, sys
import torch
from torch._dynamo.utils import counters
sys.path.insert(0, "tests")
from _tiny import compiled_steps, tiny_llama
from specontext_compile import compile_cache
action, path = sys.argv[1], sys.argv[2]
if action == "load":
    assert compile_cache.load(path)
model = tiny_llama(layers=3)
ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(0))
logits, cache = compiled_steps(model, ids, 3, budget=12)
if action == "save":
    compile_cache.save(path)
print(json.dumps({"inductor": dict(counters["inductor"]), "aot": dict(counters["aot_autograd"]),
                  "regions_compiled": counters["specontext"]["regions_compiled"],
                  "gather_sites": cache.path_counts()["gather_sites"], "logits": logits.flatten().tolist()}))
"""


def _child(action: str, path: Path, cache_dir: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    done = subprocess.run([sys.executable, "-c", CHILD, action, str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two processes each compile a decode step (about a minute on 2 cores)
def test_saved_artifacts_load_every_region_in_a_fresh_cache_folder(tmp_path):
    artifacts = tmp_path / "deploy" / "compile_cache.bin"
    first = _child("save", artifacts, tmp_path / "cache_a")
    assert artifacts.stat().st_size > 0
    regions = first["regions_compiled"]
    assert regions >= 3  # prologue, layers, epilogue: the regional path ran
    assert first["gather_sites"] > 0  # budget 12 < 41 tokens: the sparse gather ran, not the dense shortcut
    assert first["aot"].get("autograd_cache_bypass", 0) == 0
    graphs = first["inductor"].get("fxgraph_cache_miss", 0)
    assert graphs == 1  # the stitched decode graph, its regions' subgraphs inside (regional.py)

    second = _child("load", artifacts, tmp_path / "cache_b")  # an empty folder: only the file's artifacts
    assert second["aot"].get("autograd_cache_hit", 0) == graphs, second["aot"]
    assert second["aot"].get("autograd_cache_bypass", 0) == 0
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0, second["inductor"]
    assert second["logits"] == first["logits"]  # the same compiled code: bit-identical


def test_load_of_a_missing_file_is_not_an_error(tmp_path):
    assert compile_cache.load(tmp_path / "not_yet.bin") is False


def test_load_of_another_file_names_the_fix(tmp_path):
    other = tmp_path / "prompt.txt"
    other.write_text("not a cache")
    with pytest.raises(ValueError, match="delete it or give another path"):
        compile_cache.load(other)


def test_no_region_bypasses_aot_autograds_cache():
    """In one process: every compiled region was looked up in AOTAutograd's cache (hit or
    miss, none bypassed for calling our lowered functions), so a later process can load it."""
    import torch
    from _tiny import compiled_steps, tiny_llama
    from torch._dynamo.utils import counters

    counters.clear()
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    _, cache = compiled_steps(tiny_llama(layers=3), ids, 2, budget=12)
    aot = counters["aot_autograd"]
    assert cache.path_counts()["gather_sites"] > 0
    assert aot.get("autograd_cache_bypass", 0) == 0, dict(aot)
    assert counters["specontext"]["regions_compiled"] >= 3  # the regional path ran
    assert aot.get("autograd_cache_hit", 0) + aot.get("autograd_cache_miss", 0) >= 1


def test_cpu_graphs_skip_inductors_isa_probe_only_where_our_kernels_built(monkeypatch):
    """Inductor's vector-ISA probe (a build and a new Python process per ISA, about 1.2 s of a
    warm restart's first step) is skipped for CPU graphs only where our own -march=native kernels
    built with the same compiler; a CUDA graph, or a machine where they did not build, keeps it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from specontext_compile import backend
    from specontext_compile.config import SpeContextConfig
    from specontext_compile.runtime import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no C++ compiler here: the probe stays, nothing to check")
    config = SpeContextConfig.from_options({"budget": 64})
    cpu_patches = backend.inductor_patches(config, "default", [torch.zeros(2)])
    assert cpu_patches.get("cpp.vec_isa_ok") is True
    assert cpu_patches.get("freezing") is True  # the other CPU default still there
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_cuda = torch.empty(2, device="cuda")
    assert "cpp.vec_isa_ok" not in backend.inductor_patches(config, "default", [on_cuda])
    monkeypatch.setattr(backend.cpu_kernels, "available", lambda: False)
    assert "cpp.vec_isa_ok" not in backend.inductor_patches(config, "default", [torch.zeros(2)])
