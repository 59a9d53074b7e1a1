"""scripts/torch_api_check.py: the torch names our code reaches, resolved in another torch's
sources without importing it (issue 55, item 1), and scripts/device_image_check.sh (slow tier:
it downloads the device image's torch sources and triton)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import torch_api_check


@pytest.fixture(scope="module")
def installed():
    return torch_api_check.TorchTree(Path(torch.__file__).parent)


def test_every_name_the_package_reaches_exists_in_the_installed_torch(installed):
    results = torch_api_check.check(installed)
    assert len(results) > 100  # the package, the device benchmarks and tests reach this many
    missing = {name: verdict for name, (verdict, _) in results.items() if verdict.startswith("missing")}
    assert not missing
    # names the lent device's torch 2.11 broke or moved before: all reached and found here
    for name in ("torch._dynamo.utils.counters", "torch.library.triton_op", "torch.library.wrap_triton",
                 "torch.fx.node.has_side_effect"):
        assert results[name][0] == "found", name


def test_planted_names_are_reported_missing_and_real_ones_found(installed, tmp_path):
    source = tmp_path / "planted.py"
    source.write_text(
        "import torch\n"
        "from torch._dynamo.utils import counters, no_such_counter\n"
        "from torch._inductor import config as inductor_config\n"
        "x = torch.fx.node.has_side_effect\n"
        "y = torch.fx.node.no_such_function\n"
        "z = inductor_config.triton.cudagraph_trees\n"
        "w = inductor_config.no_such_flag\n"
        "v = torch.ops.anything.goes\n")
    refs = torch_api_check.references(source)
    assert "torch.ops.anything.goes" not in refs  # op namespaces are made at run time
    verdicts = {name: torch_api_check.resolve(installed, name) for name in refs}
    assert verdicts["torch._dynamo.utils.counters"] == "found"
    assert verdicts["torch.fx.node.has_side_effect"] == "found"
    assert verdicts["torch._inductor.config.triton.cudagraph_trees"] == "found"  # one level into a class
    for name in ("torch._dynamo.utils.no_such_counter", "torch.fx.node.no_such_function",
                 "torch._inductor.config.no_such_flag"):
        assert verdicts[name].startswith("missing"), (name, verdicts[name])


def test_the_script_exits_1_on_a_missing_name_and_2_on_a_bad_argument(tmp_path, capsys, monkeypatch):
    source = tmp_path / "planted.py"
    source.write_text("import torch\nx = torch.fx.node.no_such_function\n")
    monkeypatch.chdir(tmp_path)  # --sources are read relative to the current folder
    assert torch_api_check.main(["--sources", "planted.py"]) == 1
    assert "missing    torch.fx.node.no_such_function" in capsys.readouterr().out
    (tmp_path / "broken.py").write_text("x = (\n")
    (tmp_path / "empty").mkdir()
    for argv, says in ((["--sources", "broken.py"], "cannot be read as Python source"),
                       (["--sources", "no_such.py"], "does not exist"),
                       (["--sources", "empty"], "holds no .py file"),
                       ([str(source), "--sources", "planted.py"], "is not a wheel"),
                       ([str(tmp_path / "empty"), "--sources", "planted.py"], "no torch/__init__.py")):
        assert torch_api_check.main(argv) == 2, argv
        assert says in capsys.readouterr().err


def test_a_function_parameter_named_like_an_import_is_not_the_import(tmp_path):
    source = tmp_path / "shadow.py"
    source.write_text("from torch._inductor import config\n"
                      "def f(config):\n    return config.budget\n"
                      "flag = config.no_such_flag\n")
    refs = torch_api_check.references(source)
    assert "torch._inductor.config.budget" not in refs
    assert "torch._inductor.config.no_such_flag" in refs


@pytest.mark.slow
def test_the_device_images_torch_and_triton_take_our_code():
    """Downloads torch 2.11's sources (its macOS wheel) and triton 3.6 (the device image's)."""
    run = subprocess.run(["bash", "scripts/device_image_check.sh"], cwd=ROOT, capture_output=True,
                         text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "0 missing" in run.stdout


def test_an_interpreter_too_old_for_the_kernels_is_refused_with_the_fix():
    """Triton 3.6's interpreter cannot run the kernels' split loops (found with the device
    image's triton on CPU); 3.7 and later can. The error names the fix."""
    from specontext_compile.codegen.launch import check_interpreter_version

    with pytest.raises(RuntimeError, match=r"pip install 'triton>=3.7'"):
        check_interpreter_version("3.6.0")
    for version in ("3.6.0", "3", "v2.7", "3.6.9.dev1"):
        with pytest.raises(RuntimeError, match=r"triton>=3.7"):
            check_interpreter_version(version)
    with pytest.raises(RuntimeError, match="cannot read triton's version 'abc'"):
        check_interpreter_version("abc")
    for version in ("3.7.0", "3.7rc1", "3.9.0", "3.10.0+git1234", "4.0.0.dev20260101"):
        check_interpreter_version(version)  # no error
