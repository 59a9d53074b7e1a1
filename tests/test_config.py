import pytest
import torch
from _tiny import tiny_llama

import specontext_compile as sc
from specontext_compile.config import SpeContextConfig


@pytest.mark.parametrize("options, match", [
    ({"budjet": 10}, "valid options are"),
    ({"budget": 0}, "budget"),
    ({"budget": 1.5}, "budget"),
    ({"budget": True}, "budget"),
    ({"sink_tokens": -1}, "sink_tokens"),
    ({"inner": "tvm"}, "inner"),
    ({"kernel": "cuda"}, "kernel"),
    ({"retrieval_layers": "8"}, "retrieval_layers"),
    ({"retrieval_layers": ()}, "retrieval_layers"),
    ({"retrieval_layers": tuple(range(9))}, "retrieval_layers"),
])
def test_bad_options_raise_value_error(options, match):
    with pytest.raises(ValueError, match=match):
        SpeContextConfig.from_options(options)


def test_bad_options_raise_through_torch_compile():
    fn = torch.compile(lambda x: x + 1, backend="specontext", options={"budjet": 3})
    with pytest.raises(Exception, match="valid options are"):
        fn(torch.ones(2))


def test_bad_options_raise_in_compile_helper():
    with pytest.raises(ValueError, match="budget"):
        sc.compile(tiny_llama(), budget=-4)


def test_retrieval_layers_normalised_and_defaults():
    from specontext_compile.config import default_retrieval_layers

    assert SpeContextConfig(retrieval_layers=8).retrieval_layers == (8,)
    assert SpeContextConfig(retrieval_layers=[2, -1]).retrieval_layers == (2, -1)
    assert default_retrieval_layers(30) == (2, 4, 8, 12, 16, 20, 24, 28)
    assert default_retrieval_layers(2) == (0, 1)


def test_defaults_are_valid():
    config = SpeContextConfig.from_options(None)
    assert config.budget == 1024 and config.inner == "auto"


def test_graph_without_attention_passes_through_unchanged(caplog):
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    x = torch.randn(3, 8)
    compiled = torch.compile(mlp, backend="specontext", options={"budget": 4})
    with caplog.at_level("INFO", logger="specontext_compile.backend"):
        torch.testing.assert_close(compiled(x), mlp(x), rtol=0, atol=0)
    report = sc.compile_reports()[-1]
    assert report.sites_total == 0 and report.sites_rewritten == 0
    assert "no attention site" in caplog.text
    targets = [str(n.target) for n in report.graph_module.graph.nodes]
    assert not any("specontext" in t for t in targets)
