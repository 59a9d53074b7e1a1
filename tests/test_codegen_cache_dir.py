"""Generated code is imported only from a folder we trust, and what runs is what we generated.

The kernel cache (codegen/compiler.py) refuses a folder that is group/world-writable or owned by
another user (falling back to a private ``mkdtemp`` folder), and a module file swapped on disk
between the write and the import never runs. Tests may run as root, so another owner is
simulated by changing the uid the check compares with."""

import logging
import os
import stat

import pytest
import torch
from specontext_compile.codegen import compiler

ENV = "SPECONTEXT_KERNEL_CACHE_DIR"


@pytest.fixture
def fresh_private_dir(monkeypatch):
    """Each test makes its own private fallback folder (and warns afresh)."""
    monkeypatch.setattr(compiler, "_PRIVATE_DIR", None, raising=False)
    monkeypatch.setattr(compiler, "_REFUSED", set(), raising=False)


def _assert_private(path):
    info = os.stat(path)
    assert info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077 == 0


def test_a_trusted_folder_is_used_and_a_new_one_is_private(tmp_path, monkeypatch, fresh_private_dir):
    folder = tmp_path / "made" / "kernels"
    monkeypatch.setenv(ENV, str(folder))
    assert compiler.cache_dir() == folder
    _assert_private(folder)


@pytest.mark.parametrize("mode, who", [(0o775, "group"), (0o757, "others"), (0o777, "group and others")])
def test_a_group_or_world_writable_folder_is_refused(tmp_path, monkeypatch, caplog, fresh_private_dir,
                                                     mode, who):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(mode)
    monkeypatch.setenv(ENV, str(folder))
    with caplog.at_level(logging.WARNING, logger=compiler.__name__):
        used = compiler.cache_dir()
    assert used != folder and used.is_dir()
    _assert_private(used)
    assert compiler.cache_dir() == used  # one private folder for the process
    assert f"{folder} refused: it is writable by {who} (mode {mode:#o}" in caplog.text


def test_a_folder_of_another_user_is_refused(tmp_path, monkeypatch, caplog, fresh_private_dir):
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    owner = os.stat(folder).st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)  # we are someone else now
    monkeypatch.setenv(ENV, str(folder))
    with caplog.at_level(logging.WARNING, logger=compiler.__name__):
        used = compiler.cache_dir()
    assert used != folder and used.is_dir()
    assert f"{folder} refused: it is owned by uid {owner}, not by this user (uid {owner + 1})" in caplog.text


def test_the_temp_dir_fallback_of_another_user_is_refused(tmp_path, monkeypatch, caplog, fresh_private_dir):
    """No explicit folder, no usable ~/.cache: the fixed name under the temp dir, made by someone
    else first, is not used."""
    monkeypatch.delenv(ENV, raising=False)
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # ~/.cache unusable
    monkeypatch.setattr(compiler.tempfile, "tempdir", str(tmp_path))
    squatted = tmp_path / f"specontext_compile-kernels-{os.getuid()}"
    squatted.mkdir(mode=0o777)
    squatted.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger=compiler.__name__):
        used = compiler.cache_dir()
    assert used != squatted and used.parent == tmp_path
    assert used.name.startswith("specontext_compile-kernels-")
    _assert_private(used)
    assert f"{squatted} refused" in caplog.text


@pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py
def test_a_module_swapped_between_write_and_import_does_not_run(tmp_path, monkeypatch, fresh_private_dir):
    from benchmarks.attention_cases import make_attention_case

    monkeypatch.setenv(ENV, str(tmp_path / "kernels"))
    marker = tmp_path / "swapped-code-ran"
    evil = f"open({str(marker)!r}, 'w').write('pwned')\nraise SystemExit('swapped module ran')\n"
    real_write = compiler._write_source
    swapped = []

    def write_then_swap(source, stem):
        path = real_write(source, stem)
        path.write_text(evil * 400)  # as long as the real module: line lookups would hit it too
        swapped.append(path)
        return path

    monkeypatch.setattr(compiler, "_write_source", write_then_swap)
    compiler.clear_cache()
    try:
        case = make_attention_case(seed=3, dtype="fp32", head_dim=64, budget=16)
        out = case.run()
    finally:
        compiler.clear_cache()  # the modules of this folder stay out of later tests
    assert swapped and all(p.read_text().startswith("open(") for p in swapped)  # the swap happened
    assert not marker.exists()
    torch.testing.assert_close(out.double(), case.reference().double(), atol=1e-4, rtol=1e-4)


def test_import_uses_the_text_written_not_the_file(tmp_path, monkeypatch, fresh_private_dir):
    """Without Triton: ``_import_file`` of a path this process wrote runs the text it wrote, and
    ``inspect`` sees that text too."""
    import inspect

    monkeypatch.setenv(ENV, str(tmp_path / "kernels"))
    source = "def launch():\n    return 'ours'\n"
    path = compiler._write_source(source, "probe")
    path.write_text("def launch():\n    return 'theirs'\n")
    module = compiler._import_file(path)
    assert module.launch() == "ours"
    assert inspect.getsource(module.launch) == source
    assert module.__file__ == str(path)
