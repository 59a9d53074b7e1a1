"""Tiny random decoders built in the tests (no downloads)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(layers: int = 3, heads: int = 6, kv_heads: int = 2, attn: str = "sdpa", seed: int = 0):
    """A random Llama with GQA (6 query heads over 2 KV heads = groups of 3)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config).eval()


def save_tiny_hf_folder(folder, family: str = "llama", attn: str = "sdpa"):
    """Save a tiny random ``family`` model and an offline word-level tokenizer that covers its
    whole vocabulary (``w0`` .. ``w127``, ``w0`` doubling as unknown/EOS) to ``folder``: a local
    Hugging Face folder that ``specontext run --model FOLDER`` loads. Returns the folder."""
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specontext_compile.tiny_models import VOCAB, tiny_family

    folder = Path(folder)
    model = tiny_family(family, attn)
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.save_pretrained(folder)
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", pad_token="w0")
    tokenizer.save_pretrained(folder)
    return folder


def compiled_steps(model, ids, steps, **options):
    """Prefill ``ids`` then ``steps`` greedy decode steps through ``torch.compile(model.forward,
    backend="specontext", options=options)`` on a fresh :class:`SpeContextCache`; returns the
    decode steps' last-position logits ``[batch, steps, vocab]`` and the cache."""
    import specontext_compile as sc

    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend="specontext", options=options)
    cache = sc.SpeContextCache(model.config, max_cache_len=ids.shape[1] + steps + 1)
    logits = []
    with torch.no_grad():
        out = forward(input_ids=ids, cache=cache, use_cache=True)
        for _ in range(steps):
            out = forward(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.stack(logits, 1), cache


def decode_graph_ops(name: str, head: str | None = None) -> int:
    """How many calls of ``name`` the decode graphs the backend rewrote since the last
    ``clear_compile_reports()`` hold (the rewritten graph, before lowering swaps each op for
    its body): what the pass inserted, whichever way the step then ran. ``name``: a
    ``specontext::`` op (``"sparse_attention"``) or a step function of ``aten_step`` the pass
    calls directly (``"head_select"``, ``"refine_selection"``); ``head``: count only the
    ``head_select`` nodes of that selection head (``"lagged-query"``, ``"draft"``)."""
    import specontext_compile as sc
    from specontext_compile.runtime import aten_step, scorers
    from specontext_compile.runtime.protocol import is_op

    target = getattr(torch.ops.specontext, name, None) or getattr(aten_step, name, None) or getattr(scorers, name)
    return sum(is_op(n, target) and (head is None or n.args[0] == head)
               for r in sc.compile_reports() if r.result.phase == "decode" for n in r.graph_module.graph.nodes)
