"""Deterministic offload compile (issue 15 item 3): the copy bandwidth is an input — the
option ``copy_bandwidth`` or the machine's calibration, measured once and kept on disk —
and part of the schedule pass's uuid, so the same inputs compile to the same graph."""

import json

import pytest
import torch
from _tiny import tiny_llama
from specontext_compile.passes.schedule import OffloadSchedulePass
from specontext_compile.runtime import calibration

import specontext_compile as sc
from specontext_compile.backend import compile_reports


@pytest.fixture
def calibration_file(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "calibration.json"
    monkeypatch.setenv("SPECONTEXT_CALIBRATION", str(path))
    monkeypatch.setattr(calibration, "_MEASURED", {})
    calls = []

    def fake_measure(device="cpu", nbytes=8 << 20):
        calls.append(device)
        return 3.0e9 + len(calls)  # a new number every time it is really measured

    monkeypatch.setattr(calibration, "measure_copy_bandwidth", fake_measure)
    return path, calls


def test_measured_once_per_machine_then_read_from_disk(calibration_file, monkeypatch):
    path, calls = calibration_file
    first = calibration.copy_bandwidth("cpu")
    assert calls == ["cpu"] and first == 3.0e9 + 1
    data = json.loads(path.read_text())
    assert data[calibration.machine_key("cpu")]["copy_bandwidth"] == first
    monkeypatch.setattr(calibration, "_MEASURED", {})  # a new process on the same machine
    assert calibration.copy_bandwidth("cpu") == first and calls == ["cpu"]
    monkeypatch.setattr(calibration, "_MEASURED", {})  # another machine: its own entry
    monkeypatch.setattr(calibration.platform, "node", lambda: "other-host")
    assert calibration.copy_bandwidth("cpu") == 3.0e9 + 2 and len(calls) == 2
    assert len(json.loads(path.read_text())) == 2


def test_a_broken_calibration_file_is_measured_again_not_trusted(calibration_file):
    path, calls = calibration_file
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert calibration.copy_bandwidth("cpu") == 3.0e9 + 1 and calls == ["cpu"]
    path.write_text(json.dumps({calibration.machine_key("cpu"): {"copy_bandwidth": -5}}))
    calibration._MEASURED.clear()
    assert calibration.copy_bandwidth("cpu") == 3.0e9 + 2  # a non-positive value is not used


def test_the_bandwidth_enters_the_schedule_uuid():
    assert OffloadSchedulePass(16, 1e9).uuid() == OffloadSchedulePass(16, 1e9).uuid()
    assert OffloadSchedulePass(16, 1e9).uuid() != OffloadSchedulePass(16, 2e9).uuid()
    for bad in (0, -1.0, float("inf"), None, True):
        with pytest.raises(ValueError, match="bandwidth"):
            OffloadSchedulePass(16, bad)
    for bad in (0, -1.0, float("inf"), "fast", True):
        with pytest.raises(ValueError, match="copy_bandwidth"):
            sc.SpeContextConfig(copy_bandwidth=bad)


def _offload_decode_graph(options):
    """Compile a tiny Llama with offload on, run prefill + 2 decode steps; the decode
    graph's code, schedule and pass uuid."""
    torch._dynamo.reset()
    model = tiny_llama(layers=2)
    forward = torch.compile(model.forward, backend="specontext", options=options)
    cache = sc.SpeContextCache(model.config, max_cache_len=64)
    from specontext_compile.runtime.offload import enable_offload

    enable_offload(cache, model, 1 << 40, options["budget"])
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = forward(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        for _ in range(2):
            logits = forward(input_ids=logits.argmax(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1]
    report = next(r for r in reversed(compile_reports()) if r.result.phase == "decode")
    schedule = report.graph_module.meta["specontext_offload_schedule"]
    return report.graph_module.code, schedule.lead, report.pass_uuid


def test_same_inputs_compile_to_the_same_graph(calibration_file):
    _, calls = calibration_file
    opts = {"budget": 16, "recent_window": 4, "sink_tokens": 2, "device_memory_bytes": 1 << 40, "inner": "eager"}
    code_a, lead_a, uuid_a = _offload_decode_graph(opts)
    calibration._MEASURED.clear()  # as in a new process: the bandwidth comes from the file
    code_b, lead_b, uuid_b = _offload_decode_graph(opts)
    assert calls == ["cpu"]  # measured once, by the first compile
    assert (code_a, lead_a, uuid_a) == (code_b, lead_b, uuid_b)
    assert "offload-schedule" in uuid_a
    # the option overrides the calibration, and a bandwidth that changes the lead changes the uuid
    _, lead_c, uuid_c = _offload_decode_graph(dict(opts, copy_bandwidth=1e3))
    assert uuid_c != uuid_a and lead_c >= lead_a and calls == ["cpu"]
