"""``specontext distill``: train a retrieval head for a model that has no EAGLE-3 draft."""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser("distill", help="train a retrieval head from the model's own attention")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", type=Path, nargs="+", required=True, help="training text files")
    p.add_argument("--out", type=Path, required=True, help="folder for config.json + model.safetensors")
    p.add_argument("--variant", choices=("embedding", "fused"), default="fused")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--chunks", type=int, default=24, help="training chunks")
    p.add_argument("--chunk-tokens", type=int, default=768, help="tokens per training chunk")
    p.add_argument("--query-rows", type=int, default=48, help="teacher query rows per chunk")


def run(args) -> int:
    from tqdm.auto import tqdm

    from .models import load_model
    from .runtime.distill import DistillConfig, distill

    model, tokenizer = load_model(args.model)
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in args.text]
    config = DistillConfig(variant=args.variant, steps=args.steps, chunk_tokens=args.chunk_tokens,
                           query_rows=args.query_rows)
    meta = distill(model, tokenizer, texts, config, args.out, args.chunks,
                   progress_factory=lambda n, desc: tqdm(total=n, desc=desc, leave=False),
                   extra_meta={"text_files": [p.name for p in args.text]})
    print(json.dumps(meta, indent=2), file=sys.stdout)
    print(f"head written to {args.out}")
    return 0
