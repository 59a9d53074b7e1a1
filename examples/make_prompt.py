"""Build examples/pydoc_prompt.txt: real English text from Python's own documentation
(``pydoc_data.topics``) followed by a question whose answer sits early in the document.

    python examples/make_prompt.py [--tokens 6500]
"""

import argparse
from pathlib import Path
from pydoc_data import topics

TOPICS = ["assert", "break", "nonlocal", "global", "with", "try", "raise", "import",
          "for", "while", "if", "lambda", "class", "function", "exceptions", "execmodel",
          "specialnames", "customization", "typesseq", "string-methods", "formatstrings"]
QUESTION = ("\n\nQuestion: according to the documentation above, what does the nonlocal "
            "statement do, and how does it differ from the global statement? Answer in a "
            "few sentences.")


def build(max_chars: int) -> str:
    text = ""
    for name in TOPICS:
        text += f"\n\n=== {name} ===\n\n" + topics.topics[name]
        if len(text) >= max_chars:
            break
    return text[:max_chars].strip() + QUESTION


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chars", type=int, default=27000, help="document length in characters")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("pydoc_prompt.txt"))
    args = parser.parse_args()
    args.out.write_text(build(args.chars) + "\n", encoding="utf-8")
