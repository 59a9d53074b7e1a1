"""Distil a retrieval head from the target model's own attention (issue 6, part).

For models without an EAGLE-3 draft, train a head of the same shape (embedding ++ fused
auxiliary hidden states -> RMSNorm -> Q/K projections with RoPE) whose attention over the
context imitates the target's: the teacher distribution of each KV head is the target's
attention of the chosen query rows, max over the query heads of the group, averaged over all
layers (SpeContext shares one selection across layers, so the head should predict what the
layers attend to on average). Loss: KL(teacher || head softmax) per KV head and query row.

Two variants, both written in the EAGLE-3 layout (``config.json`` + ``model.safetensors``)
so :func:`~specontext_compile.runtime.eagle3.load_eagle3_head` loads them:
``embedding`` (the fused-hidden half of the input is zero) and ``fused`` (the target's hidden
states after three layers, of the *previous* token, as EAGLE-3 uses them).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .eagle3 import Eagle3RetrievalHead

logger = logging.getLogger(__name__)

__all__ = ["DistillConfig", "TeacherBatch", "teacher_batch", "train_head", "save_head"]


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Training settings (token counts, steps; defaults sized for 2 CPU cores)."""

    variant: str = "fused"  # "embedding" or "fused"
    chunk_tokens: int = 768
    query_rows: int = 48  # teacher rows per chunk (the last ones: most context)
    init_layer: int = 8  # target layer whose Q/K projections initialise the head
    aux_layers: tuple[int, int, int] = (2, 15, 28)
    steps: int = 200
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.variant not in ("embedding", "fused"):
            raise ValueError(f"variant must be 'embedding' or 'fused', got {self.variant!r}")
        if self.query_rows < 1 or self.chunk_tokens <= self.query_rows or self.steps < 1:
            raise ValueError("need chunk_tokens > query_rows >= 1 and steps >= 1")


@dataclasses.dataclass
class TeacherBatch:
    """One chunk: ids ``[1, T]``, aux hidden ``[1, T, 3*hidden]`` (previous token's),
    teacher ``[num_kv_heads, R, T]`` distributions for the last ``R`` query rows."""

    input_ids: torch.Tensor
    aux_hidden: torch.Tensor
    teacher: torch.Tensor


def teacher_batch(model, input_ids: torch.Tensor, config: DistillConfig) -> TeacherBatch:
    """Run the target once over ``input_ids`` ``[1, T]`` and collect the teacher targets."""
    rows, sums = config.query_rows, []

    def recording(module, q, k, v, mask, **kw):
        groups = q.shape[1] // k.shape[1]
        logits = q[:, :, -rows:].float() @ k.repeat_interleave(groups, 1).float().transpose(-1, -2)
        t = k.shape[2]
        causal = torch.arange(t)[None, :] > torch.arange(t - rows, t)[:, None]
        probs = torch.softmax((logits * module.scaling).masked_fill(causal, float("-inf")), -1)
        sums.append(probs[0].view(k.shape[1], groups, rows, t).amax(1))
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("specontext_distill", recording)
    model.set_attn_implementation("specontext_distill")
    try:
        with torch.no_grad():
            out = model(input_ids, cache=DynamicCache(config=model.config), use_cache=True,
                        output_hidden_states=True)
    finally:
        model.set_attn_implementation("sdpa")
    teacher = torch.stack(sums).mean(0)
    teacher = teacher / teacher.sum(-1, keepdim=True)
    aux = torch.cat([out.hidden_states[j + 1] for j in config.aux_layers], -1)
    aux = torch.cat([torch.zeros_like(aux[:, :1]), aux[:, :-1]], 1)  # previous token's states
    return TeacherBatch(input_ids, aux, teacher)


def _initial_tensors(model, config: DistillConfig) -> tuple[dict, dict]:
    attn = model.model.layers[config.init_layer].self_attn
    norm = model.model.layers[config.init_layer].input_layernorm.weight
    hidden = model.config.hidden_size
    num_kv, d = model.config.num_key_value_heads, attn.head_dim
    gen = torch.Generator().manual_seed(config.seed)
    # the head has one query head per KV head: start from the first query head of each group
    groups = model.config.num_attention_heads // num_kv
    q_rows = torch.cat([attn.q_proj.weight[h * groups * d : (h * groups + 1) * d] for h in range(num_kv)])
    k_rows = attn.k_proj.weight
    zeros = torch.zeros(num_kv * d, hidden)
    tensors = {
        "fc.weight": torch.randn(hidden, 3 * hidden, generator=gen) * (0.02 if config.variant == "fused" else 0.0),
        "midlayer.input_layernorm.weight": norm.detach().clone(),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": torch.cat([q_rows.detach(), zeros], 1),
        "midlayer.self_attn.k_proj.weight": torch.cat([k_rows.detach(), zeros.clone()], 1),
    }
    head_config = {
        "hidden_size": hidden, "num_attention_heads": num_kv, "num_key_value_heads": num_kv,
        "head_dim": d, "vocab_size": model.config.vocab_size, "draft_vocab_size": model.config.vocab_size,
        "rms_norm_eps": model.config.rms_norm_eps,
        "rope_theta": model.config.rope_parameters["rope_theta"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(config.aux_layers)},
        "specontext_variant": config.variant,
    }
    return tensors, head_config


def _loss(head: Eagle3RetrievalHead, batch: TeacherBatch, fused: bool) -> torch.Tensor:
    t, rows = batch.input_ids.shape[1], batch.teacher.shape[1]
    aux = batch.aux_hidden if fused else torch.zeros_like(batch.aux_hidden)
    q, k = head(batch.input_ids, aux, torch.arange(t)[None])
    logits = (q[0, :, -rows:] @ k[0].transpose(-1, -2)) * head.head_dim**-0.5  # [kv, R, T]
    causal = torch.arange(t)[None, :] > torch.arange(t - rows, t)[:, None]
    logp = torch.log_softmax(logits.masked_fill(causal, float("-inf")), -1)
    teacher = batch.teacher
    return (teacher * (teacher.clamp_min(1e-12).log() - logp.masked_fill(causal, 0.0))).sum(-1).mean()


def train_head(model, batches: list[TeacherBatch], config: DistillConfig, progress=None):
    """Train the head on the teacher batches; returns ``(head, head_config, losses)``."""
    tensors, head_config = _initial_tensors(model, config)
    tensors["embed_tokens.weight"] = model.model.embed_tokens.weight.detach()
    head = Eagle3RetrievalHead(head_config, tensors)
    trainable = [head.q_proj, head.k_proj, head.input_norm]
    if config.variant == "fused":
        trainable += [head.fc, head.hidden_norm]
    for p in trainable:
        p.requires_grad_(True)
    opt = torch.optim.Adam(trainable, lr=config.lr)
    losses = []
    for step in range(config.steps):
        batch = batches[step % len(batches)]
        loss = _loss(head, batch, config.variant == "fused")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress.update(1)
    for p in trainable:
        p.requires_grad_(False)
    return head, head_config, losses


def save_head(head: Eagle3RetrievalHead, head_config: dict, folder: Path, meta: dict) -> None:
    """Write ``config.json`` + ``model.safetensors`` (EAGLE-3 names; the embedding is not
    stored: the target's is passed at load time)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        "fc.weight": head.fc, "midlayer.input_layernorm.weight": head.input_norm,
        "midlayer.hidden_norm.weight": head.hidden_norm,
        "midlayer.self_attn.q_proj.weight": head.q_proj,
        "midlayer.self_attn.k_proj.weight": head.k_proj,
    }
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**head_config, "specontext_training": meta}, indent=2))


def chunks_from_texts(tokenizer, texts: list[str], chunk_tokens: int, max_chunks: int) -> list[torch.Tensor]:
    """Split tokenised texts into ``[1, chunk_tokens]`` chunks (at most ``max_chunks``)."""
    out = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        for start in range(0, ids.shape[1] - chunk_tokens + 1, chunk_tokens):
            out.append(ids[:, start : start + chunk_tokens])
            if len(out) >= max_chunks:
                return out
    return out


def distill(model, tokenizer, texts: list[str], config: DistillConfig, out_dir: Path,
            max_chunks: int = 24, progress_factory=None, extra_meta: dict | None = None) -> dict:
    """The whole recipe: teacher targets from ``texts``, training, and the saved head.

    Returns the training record written into the head's ``config.json``
    (chunks, tokens, first/last loss, settings).

    Raises:
        ValueError: when the texts give no full chunk.
    """
    chunks = chunks_from_texts(tokenizer, texts, config.chunk_tokens, max_chunks)
    if not chunks:
        raise ValueError(f"the training texts hold fewer than {config.chunk_tokens} tokens")
    bar = progress_factory(len(chunks), "teacher") if progress_factory else None
    batches = []
    for chunk in chunks:
        batches.append(teacher_batch(model, chunk, config))
        if bar is not None:
            bar.update(1)
    bar = progress_factory(config.steps, "train") if progress_factory else None
    head, head_config, losses = train_head(model, batches, config, bar)
    window = max(1, len(losses) // 10)
    meta = {
        **dataclasses.asdict(config), "chunks": len(chunks),
        "tokens": len(chunks) * config.chunk_tokens,
        "loss_first": sum(losses[:window]) / window, "loss_last": sum(losses[-window:]) / window,
        **(extra_meta or {}),
    }
    save_head(head, head_config, out_dir, meta)
    return meta
