"""``specontext explain``: the attention-site table of a model (see :mod:`.explain`).

``specontext explain --model tiny:mistral [--attn sdpa] [--budget 64] [--prompt-tokens 32]
[--retrieval-head DIR] [--dump-dir DIR] [--json OUT]``. ``--model`` takes what ``specontext run`` takes
(``smollm2-135m``, a ``.gguf`` file, a local Hugging Face folder) or ``tiny:<family>``, a tiny
random model of one of :data:`specontext_compile.tiny_models.FAMILIES` (no download).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["add_explain_parser", "cmd_explain"]


def add_explain_parser(sub) -> None:
    p = sub.add_parser("explain", help="table of attention sites: rewritten or dense and why")
    p.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m, a .gguf file, a local Hugging Face folder, or tiny:<family>")
    p.add_argument("--attn", default=None, choices=("eager", "sdpa"),
                   help="attn_implementation (tiny models: default sdpa; others: as loaded)")
    p.add_argument("--budget", type=int, default=1024, help="selected tokens per KV head")
    p.add_argument("--prompt-tokens", type=int, default=32, help="length of the random prompt")
    p.add_argument("--decode-steps", type=int, default=1)
    p.add_argument("--retrieval-head", default=None, metavar="DIR",
                   help="draft retrieval head folder (EAGLE-3 layout) for the selection")
    p.add_argument("--dump-dir", default=None, help="write graph dumps (text + DOT) here")
    p.add_argument("--device-memory-bytes", type=int, default=None,
                   help="KV offload with this device tier (bytes): also print the memory model's plan, "
                        "thresholds and expected bytes per step")
    p.add_argument("--json", type=Path, default=None, help="also write the table as JSON")
    p.add_argument("-v", "--verbose", action="store_true")


def cmd_explain(args) -> int:
    import torch

    from .explain_report import explain

    if args.model.startswith("tiny:"):
        from .tiny_models import tiny_family

        model = tiny_family(args.model.split(":", 1)[1], args.attn or "sdpa")
    else:
        from .models import load_model

        model, _ = load_model(args.model)
        if args.attn:
            model.set_attn_implementation(args.attn)
    if args.prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    options = {"budget": args.budget}
    if args.retrieval_head:
        options["retrieval_head"] = args.retrieval_head
    if args.dump_dir:
        options["dump_dir"] = args.dump_dir
    if args.device_memory_bytes is not None:
        options["device_memory_bytes"] = args.device_memory_bytes
    result = explain(model, ids, decode_steps=args.decode_steps, **options)
    print(f"model: {args.model}  attn: {model.config._attn_implementation}  prompt tokens: {args.prompt_tokens}")
    print(result.table())
    if args.json:  # checked writable before the model loaded (cli.check_paths)
        from .cli_json import write_json

        return write_json(args.json, result.to_dict(), "table")
    return 0
