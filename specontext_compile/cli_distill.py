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
    p.add_argument("--teacher-cache", type=Path, default=None,
                   help="file for the teacher targets: reused when it matches, else written")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial fc and the random positions")
    p.add_argument("--positions", choices=("contiguous", "random", "random_span"), default="contiguous",
                   help="head RoPE positions while training: the chunk's own; a sorted random subset "
                        "of [0, --max-position) per step; or of a random span up to --max-position")
    p.add_argument("--max-position", type=int, default=8192,
                   help="upper end of the random positions (tokens)")
    p.add_argument("--rope", choices=("default", "linear", "dynamic", "none"), default="default",
                   help="the head's RoPE, saved as rope_scaling in config.json")
    p.add_argument("--rope-factor", type=float, default=1.0, help="position-interpolation factor (--rope linear)")
    p.add_argument("--loss-sink", type=int, default=0,
                   help="first tokens left out of the loss (the selection keeps them anyway)")
    p.add_argument("--loss-window", type=int, default=0,
                   help="recent tokens before each query row left out of the loss (kept anyway)")


def run(args) -> int:
    from tqdm.auto import tqdm

    from .models import load_model
    from .runtime.distill import DistillConfig, distill

    config = DistillConfig(variant=args.variant, steps=args.steps, chunk_tokens=args.chunk_tokens,
                           max_chunks=args.chunks,
                           query_rows=args.query_rows, lr=args.lr, seed=args.seed, positions=args.positions,
                           max_position=args.max_position, rope=args.rope, rope_factor=args.rope_factor,
                           loss_sink=args.loss_sink, loss_window=args.loss_window)  # ValueError (before loading anything): cli.main
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in args.text]  # before loading
    model, tokenizer = load_model(args.model)  # --out / --teacher-cache: checked by cli.check_paths
    meta = distill(model, tokenizer, texts, config, args.out,
                   progress_factory=lambda n, desc: tqdm(total=n, desc=desc, leave=False),
                   extra_meta={"text_files": [str(p) for p in args.text]}, teacher_cache=args.teacher_cache)
    print(json.dumps(meta, indent=2), file=sys.stdout)
    print(f"head written to {args.out}")
    return 0
