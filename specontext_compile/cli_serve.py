"""``specontext serve``: Hugging Face's OpenAI-compatible server with the backend in every step."""

from __future__ import annotations

import json

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible API, continuous batching "
                                     "compiled with specontext")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, a .gguf file or a local Hugging Face folder")
    p.add_argument("--budget", type=int, default=1024, help="selected tokens per KV head")
    p.add_argument("--options", default="{}",
                   help='other backend options as JSON, e.g. \'{"sink_tokens": 4, "recent_window": 64}\'')
    p.add_argument("--host", default="localhost")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, ... or auto (the checkpoint's)")
    p.add_argument("--num-blocks", type=int, default=512, help="KV cache pages of the engine")
    p.add_argument("--page-size", type=int, default=32, help="tokens per KV cache page")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per engine step")
    p.add_argument("--max-requests", type=int, default=8, help="requests per engine step (decode steps pad to it)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds requests in flight may still take after Ctrl-C; then they get an error response")
    p.add_argument("-v", "--verbose", action="store_true")


def run(args) -> int:
    from .serve import build_server

    try:
        options = json.loads(args.options)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--options must be a JSON object, e.g. '{{\"sink_tokens\": 4}}'; {exc}: {args.options!r}") from None
    if not isinstance(options, dict):
        raise ValueError(f"--options must be a JSON object, got {args.options!r}")
    options.setdefault("budget", args.budget)
    server = build_server(args.model, options, host=args.host, port=args.port, dtype=args.dtype, grace=args.grace,
                          engine=dict(num_blocks=args.num_blocks, page_size=args.page_size,
                                      max_batch_tokens=args.max_batch_tokens,
                                      max_requests_per_batch=args.max_requests))
    from .serve import COUNTERS_ROUTE

    print(f"specontext serve: {server.model_id} on http://{args.host}:{args.port}/v1 "
          f"(model name for requests: {server.model_name!r}; the sparse path's counters: "
          f"GET http://{args.host}:{args.port}{COUNTERS_ROUTE}); Ctrl-C stops it", flush=True)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled once it has shut down
        pass
    return 0
