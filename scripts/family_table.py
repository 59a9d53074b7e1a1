"""Print the family x attn_implementation table of docs/families.md (Markdown).

    .venv/bin/python scripts/family_table.py > /tmp/families.md

Same runs as tests/test_families.py (tiny random 2-layer models, prompt 30 tokens, 20 decode
steps, budget 128 >= context): per case, decode-graph attention sites rewritten, the reasons
of the rest, per-layer window / soft cap seen by the pass, and the max |logit| difference
between compiled specontext decoding and eager dense decoding (prefill + 20 steps).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _families import DECODE_STEPS, FAMILIES, PROMPT_TOKENS, run_family


def main() -> int:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; prompt "
          f"{PROMPT_TOKENS} tokens + {DECODE_STEPS} decode steps, budget 128, fp32 CPU\n")
    print("| family | attn | decode sites rewritten | layers (window / soft cap) | max abs logit err | fallback reason |")
    print("|---|---|---|---|---|---|")
    for family in FAMILIES:
        for attn in ("eager", "sdpa"):
            torch._dynamo.reset()
            try:
                r = run_family(family, attn)
            except ValueError as err:
                print(f"| {family} | {attn} | n/a | | | transformers refuses it: {str(err).split('.')[0]} |")
                continue
            sites = [s for rep in r["reports"] for s in rep.result.sites]
            layers = ", ".join(
                f"{s.layer}:{'full' if not s.window else s.window}" + (f"/cap {s.soft_cap:g}" if s.soft_cap else "")
                for s in sites if s.layer is not None)
            reasons = "; ".join(r["reasons"]) or "-"
            print(f"| {family} | {attn} | {r['decode_rewritten']}/{r['decode_sites']} | {layers} | "
                  f"{r['max_err']:.1e} | {reasons} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
