"""Tensor parallelism (issue 13): a tiny Llama loaded with ``tp_plan="auto"`` on 2 ranks
(``torch.distributed.run``, gloo on CPU) generates through the backend exactly as one process
does, at full budget (gather path) and at budget 32, with the same selection per KV head and
no communication beyond Hugging Face's own row-parallel all-reduces (docs/scale-out.md).

The 2-rank job runs ``tests/_tp_worker.py`` (about a minute on 2 busy cores: the inductor
case compiles one decode graph per rank)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from specontext_compile.passes.sparse_rewrite import keeps_side_effects
from specontext_compile.runtime.kv_cache import SpeContextCache
from torch import fx
from transformers import LlamaConfig

WORKER = Path(__file__).with_name("_tp_worker.py")
LAYERS = 2


def test_retrieval_state_follows_local_heads():
    """The retrieval state holds the query heads of the KV heads the layer-0 keys carry: all
    of them in one process, ``heads * local_kv / kv_heads`` on a tensor-parallel rank."""
    config = LlamaConfig(vocab_size=32, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2)
    cache = SpeContextCache(config, max_cache_len=8)
    whole, shard = torch.zeros(1, 2, 3, 16), torch.zeros(1, 1, 3, 16)
    assert cache._retrieval_heads(whole) == 4 and cache._retrieval_heads(shard) == 2
    cache.update(shard, shard, 0)
    assert cache.query_state.shape[1:] == (1, 2, 1, 16)
    mqa = SpeContextCache(LlamaConfig(vocab_size=32, hidden_size=64, num_hidden_layers=1,
                                      num_attention_heads=4), max_cache_len=8)
    mqa.num_kv_heads = None  # a config without a KV head count (Falcon's multi-query)
    assert mqa._retrieval_heads(torch.zeros(1, 1, 3, 16)) == 4


def test_dead_code_keeps_in_place_copies():
    """Dynamo records HF TP's in-place all-reduce as a functional one plus ``copy_`` back
    into the input, whose result is unused: the pass's dead-code step must keep it."""
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    reduced = graph.call_function(torch.add, (y, 1))
    graph.call_method("copy_", (x, reduced))
    graph.call_function(torch.relu_, (y,))
    graph.call_function(torch.mul, (x, 2))  # unused and pure: removed
    graph.output(x)
    graph.eliminate_dead_code(is_impure_node=keeps_side_effects)
    kept = [n.target for n in graph.nodes if n.op in ("call_method", "call_function")]
    assert kept == [torch.add, "copy_", torch.relu_]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    assert done.returncode == 0, f"{' '.join(args[:4])} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with the gloo backend is not available in this build")
@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path):
    folder, single = tmp_path / "model", tmp_path / "single.json"
    _run([str(WORKER), "build", str(folder)])
    _run([str(WORKER), "run", str(folder), str(single)])
    _run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
          "--master-port", str(_free_port()), str(WORKER), "run", str(folder), str(tmp_path / "tp.json"),
          "--inductor"])
    ref = json.loads(single.read_text())
    ranks = [json.loads((tmp_path / f"tp.rank{r}.json").read_text()) for r in range(2)]

    # the reference is meaningful: exact at full budget, a real selection at budget 32
    assert ref["cases"]["full"]["tokens"] == ref["dense_tokens"]
    assert ref["cases"]["budget32"]["tokens"] != ref["dense_tokens"]
    for r, rank in enumerate(ranks):
        # HF's Llama plan keeps each KV head with its query group on one rank
        assert rank["tp_plan"]["layers.*.self_attn.o_proj"] == "rowwise"
        assert rank["local_kv_heads"] == 1 and rank["local_q_heads"] == 2
        assert rank["dense_tokens"] == ref["dense_tokens"]
        for name in ("full", "budget32", "budget32_inductor"):
            case, expected = rank["cases"][name], ref["cases"][name.removesuffix("_inductor")]
            assert case["tokens"] == expected["tokens"], (r, name)
            assert case["reports"][-1] == [LAYERS, LAYERS], (r, name)  # the decode graph
            assert case["path_counts"] == expected["path_counts"], (r, name)
            assert case["path_counts"]["gather_sites"] > 0 and case["path_counts"]["dense_store_sites"] == 0
            assert case["query_state_heads"] == rank["local_q_heads"]
            # the selection adds no communication: HF's two row-parallel all-reduces per layer
            assert case["collectives"][-1] == 2 * LAYERS, (r, name)
        assert rank["cases"]["budget32_inductor"]["lowered"][-1]
        for name in ("full", "budget32"):  # same selection per KV head as the one process
            mine, whole = rank["cases"][name]["selections"], ref["cases"][name]["selections"]
            assert len(mine) == len(whole) == ref["cases"][name]["path_counts"]["decode_steps"]
            for step_mine, step_whole in zip(mine, whole):
                lo, hi = rank["kv_heads"]
                assert [row[lo:hi] for row in step_whole] == step_mine, (r, name)
