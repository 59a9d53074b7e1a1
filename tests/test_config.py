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


def test_options_come_in_four_groups_flat_or_nested():
    """Issue 27 item 1: every option belongs to exactly one group (selection, compile,
    offload, debug); the config reads as groups (``config.selection`` ...), and
    ``torch.compile`` options may give a group as a dict or a group instance, the same
    config as the flat names."""
    import dataclasses

    from specontext_compile.config import OPTION_GROUPS, CompileOptions, SelectionOptions

    assert [f.name for f in dataclasses.fields(SpeContextConfig)] == list(OPTION_GROUPS)  # stored as the groups
    grouped = [f.name for group in OPTION_GROUPS.values() for f in dataclasses.fields(group)]
    assert len(grouped) == len(set(grouped)) == 25
    assert all(getattr(SpeContextConfig(), name) == getattr(getattr(SpeContextConfig(), group), name)
               for group, cls in OPTION_GROUPS.items() for name in (f.name for f in dataclasses.fields(cls)))
    flat = SpeContextConfig.from_options({"budget": 512, "page_rescue": 0, "inner": "eager", "dump_dir": "x"})
    nested = SpeContextConfig.from_options({"selection": {"budget": 512, "page_rescue": 0},
                                            "compile": {"inner": "eager"}, "debug": {"dump_dir": "x"}})
    assert nested == flat
    assert flat.selection.budget == 512 and flat.selection.page_rescue == 0 and flat.compile.inner == "eager"
    assert flat.offload.device_memory_bytes is None and flat.debug.dump_dir == "x"
    assert isinstance(flat.selection, SelectionOptions) and isinstance(flat.compile, CompileOptions)
    again = SpeContextConfig.from_options({"selection": flat.selection, "compile": flat.compile})
    assert again == dataclasses.replace(flat, dump_dir=None)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['inner'\] in specontext option group 'selection'"):
        SpeContextConfig.from_options({"selection": {"inner": "eager"}})
    with pytest.raises(ValueError, match=r"\['budget'\] given both on their own and in group 'selection'"):
        SpeContextConfig.from_options({"budget": 8, "selection": {"budget": 16}})
    with pytest.raises(ValueError, match="must be a dict or a CompileOptions"):
        SpeContextConfig.from_options({"compile": "eager"})


def test_each_group_validates_its_own_fields_and_the_config_the_rules_across_them():
    """Issue 53 item 5: the options are stored as their groups; a group built alone checks its
    fields (the same messages as the flat names), the config only the rules across groups; a
    flat name given with its group goes on top of it (as ``dataclasses.replace`` passes it)."""
    import dataclasses

    from specontext_compile.config import CompileOptions, OffloadOptions, SelectionOptions

    with pytest.raises(ValueError, match="'budget' must be an int >= 1"):
        SelectionOptions(budget=0)
    with pytest.raises(ValueError, match="'kernel' must be one of"):
        CompileOptions(kernel="cuda")
    with pytest.raises(ValueError, match="needs device_memory_bytes"):
        OffloadOptions(offload_trace="step.json")
    assert SelectionOptions(budget=100).page_rescue == 200  # the default rescue, normalised in its group
    offload = OffloadOptions(device_memory_bytes=1 << 20)
    assert SpeContextConfig(offload=offload).device_memory_bytes == 1 << 20
    with pytest.raises(ValueError, match="'min_coverage' > 0 and 'device_memory_bytes'"):
        SpeContextConfig(offload=offload, selection=SelectionOptions(min_coverage=0.5))
    config = SpeContextConfig(selection=SelectionOptions(budget=64, sink_tokens=2), budget=32)
    assert config.budget == config.selection.budget == 32 and config.sink_tokens == 2
    assert config.page_rescue == 64  # the default rescue follows the new budget (2 x budget)
    assert dataclasses.replace(SpeContextConfig(budget=64), budget=32) == SpeContextConfig(budget=32)
    assert SpeContextConfig(selection={"budget": 5}) == SpeContextConfig(budget=5)  # a group as a dict
    assert SpeContextConfig.from_options({"selection": SelectionOptions(sink_tokens=2), "budget": 8}).budget == 8
    runner = _Runner().run
    assert SpeContextConfig.from_options({"compile": CompileOptions(inner=runner)}).inner == runner  # not a copy
    with pytest.raises(ValueError, match="must be a dict or a CompileOptions"):
        SpeContextConfig(compile=SelectionOptions())
    with pytest.raises(AttributeError):
        config.not_an_option
    assert "budget" in dir(config)


class _Runner:
    def run(self, gm):
        return gm


def test_grouped_options_are_refused_where_their_flat_names_are():
    """Continuous batching and the vLLM plugin refuse options they do not build by name; given
    in a group (a dict or an instance), the same options are refused the same way."""
    from specontext_compile.config import OffloadOptions
    from specontext_compile.serving import check_options

    with pytest.raises(ValueError, match="min_coverage"):
        check_options({"selection": {"min_coverage": 0.5}})
    plugin = pytest.importorskip("specontext_vllm.options")
    from types import SimpleNamespace

    for given in ({"device_memory_bytes": 10**9}, {"offload": {"device_memory_bytes": 10**9}},
                  {"offload": OffloadOptions(device_memory_bytes=10**9)}):
        with pytest.raises(ValueError, match="device_memory_bytes=1000000000 is not built in the vLLM plugin"):
            plugin.plugin_options(SimpleNamespace(additional_config={"specontext": given}))


def test_grouped_options_reach_the_backend():
    """A grouped option compiles as its flat name does: the selection's budget reaches the
    step (8 positions per KV head at a 20-token context, counted on the gather path)."""
    from specontext_compile.backend import clear_compile_reports
    from specontext_compile.passes.sites import is_op
    from specontext_compile.runtime.protocol import op_arguments

    model = tiny_llama(layers=2)
    clear_compile_reports()
    forward = torch.compile(model.forward, backend="specontext",
                            options={"selection": {"budget": 8, "page_rescue": 0}, "compile": {"inner": "eager"}})
    cache = sc.SpeContextCache(model.config, max_cache_len=32)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = forward(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        forward(input_ids=logits.argmax(-1, keepdim=True), cache=cache, use_cache=True)
    decode = [r for r in sc.compile_reports() if r.result.phase == "decode"]
    assert decode and decode[-1].config.selection.budget == 8 and decode[-1].config.compile.inner == "eager"
    assert cache.path_counts()["gather_sites"] == 2
    sparse = [n for n in decode[-1].graph_module.graph.nodes if is_op(n, torch.ops.specontext.sparse_attention)]
    assert len(sparse) == 2
    assert all(op_arguments(n, torch.ops.specontext.sparse_attention)["spec"].budget == 8 for n in sparse)
