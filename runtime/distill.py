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
states after three layers, of the *previous* token, as EAGLE-3 uses them). The layers are
saved in EAGLE-3's numbering (the output of layer ``j`` is id ``j + 1``, the input of layer
``j + 1``) with ``"specontext_aux_convention": "input"``; heads saved before that field existed
name layer outputs and are still read that way (:mod:`.eagle3`).

Length generalisation (a head trained on short chunks must score 8K contexts):

* ``positions="random"``: the teacher is always the target's real attention at the chunk's
  real positions, but the *head's* RoPE positions of each training step are a sorted random
  subset of ``[0, max_position)`` (randomised positional encodings, Ruoss et al. 2023): the
  order of tokens is kept and the head sees relative distances up to ``max_position``, so it
  has to rank by content rather than by a distance it never saw. At inference the head runs
  at the true positions (nothing in ``config.json`` changes). The price: every distance is
  stretched (by ``max_position / chunk_tokens`` on average), so the head's recency prior is
  learnt on distances longer than the real ones. ``positions="random_span"`` draws the
  stretch per step instead: a span uniform in ``[chunk_tokens, max_position]``, a random
  offset, and a sorted random subset of that span, so short (near-true) and long distances
  are both seen.
* ``rope="linear"`` (position interpolation, factor ``rope_factor``), ``rope="dynamic"``
  (untouched up to the chunk length, compressed beyond) or ``rope="none"`` (no RoPE): written
  to ``config.json`` as ``rope_scaling`` and honoured by
  :class:`~specontext_compile.runtime.eagle3.Eagle3RetrievalHead` at training and inference.
* ``loss_sink`` / ``loss_window``: the selection always keeps the first ``loss_sink`` tokens
  and the ``loss_window`` most recent ones, so the loss can leave them out and match the
  teacher's distribution renormalised over the tokens the head actually has to rank.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .eagle3 import CONVENTION_KEY, ROPE_TYPES, Eagle3RetrievalHead
from .sparse_attention import query_key_logits

logger = logging.getLogger(__name__)

__all__ = ["DistillConfig", "TeacherBatch", "chunks_from_texts", "distill", "save_head", "teacher_batch",
           "train_head", "training_positions"]

POSITION_SCHEMES = ("contiguous", "random", "random_span")


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Training settings (token counts, steps; defaults sized for 2 CPU cores).

    Attributes:
        variant: ``"embedding"`` (token embedding only) or ``"fused"`` (plus the target's
            auxiliary hidden states of the previous token).
        chunk_tokens: tokens per training chunk (the teacher's context length).
        max_chunks: training chunks at most (cut from the texts in order; >= 1).
        query_rows: teacher query rows per chunk (the last ones: most context).
        init_layer: target layer whose Q/K projections initialise the head.
        aux_layers: 0-based target layers whose outputs (Hugging Face ``hidden_states[j + 1]``)
            feed the fused variant; saved in the EAGLE-3 numbering (id ``j + 1``, the input of
            the next layer) with ``"specontext_aux_convention": "input"`` (see :mod:`.eagle3`).
        steps, lr, seed: optimisation (Adam) settings; ``seed`` also drives the random positions.
        positions: ``"contiguous"`` (head RoPE at the chunk's true positions),
            ``"random"`` (a sorted random subset of ``[0, max_position)`` per step) or
            ``"random_span"`` (a random span in ``[chunk_tokens, max_position]`` per step).
        max_position: upper end (exclusive, tokens) of the random positions.
        rope: ``"default"``, ``"linear"``, ``"dynamic"`` or ``"none"`` (see the module doc);
            saved as the head's ``rope_scaling``.
        rope_factor: position-interpolation factor for ``rope="linear"`` (>= 1).
        loss_sink, loss_window: tokens at the start / before each query row left out of the
            loss (0, 0 = every causal token counts).
    """

    variant: str = "fused"
    chunk_tokens: int = 768
    max_chunks: int = 24
    query_rows: int = 48
    init_layer: int = 8
    aux_layers: tuple[int, int, int] = (2, 15, 28)
    steps: int = 200
    lr: float = 3e-3
    seed: int = 0
    positions: str = "contiguous"
    max_position: int = 8192
    rope: str = "default"
    rope_factor: float = 1.0
    loss_sink: int = 0
    loss_window: int = 0

    def __post_init__(self) -> None:
        if self.variant not in ("embedding", "fused"):
            raise ValueError(f"variant must be 'embedding' or 'fused', got {self.variant!r}")
        if self.query_rows < 1 or self.chunk_tokens <= self.query_rows or self.steps < 1 or self.max_chunks < 1:
            raise ValueError("need chunk_tokens > query_rows >= 1, steps >= 1 and max_chunks >= 1")
        if self.positions not in POSITION_SCHEMES:
            raise ValueError(f"positions must be one of {POSITION_SCHEMES}, got {self.positions!r}")
        if self.positions != "contiguous" and self.max_position < self.chunk_tokens:
            raise ValueError(f"random positions need max_position >= chunk_tokens "
                             f"({self.max_position} < {self.chunk_tokens})")
        if self.rope not in ROPE_TYPES:
            raise ValueError(f"rope must be one of {ROPE_TYPES}, got {self.rope!r}")
        if self.rope_factor < 1.0 or (self.rope != "linear" and self.rope_factor != 1.0):
            raise ValueError(f"rope_factor must be >= 1 and is only used by rope='linear' "
                             f"(got {self.rope_factor} with rope={self.rope!r})")
        if self.loss_sink < 0 or self.loss_window < 0:
            raise ValueError("loss_sink and loss_window must be >= 0")
        if self.chunk_tokens - self.query_rows <= self.loss_sink + self.loss_window:
            raise ValueError("the first query row must see tokens outside the sinks and the window: "
                             "need chunk_tokens - query_rows > loss_sink + loss_window")

    @property
    def rope_scaling(self) -> dict | None:
        """The ``rope_scaling`` entry written to the head's ``config.json`` (None = plain)."""
        if self.rope == "default":
            return None
        if self.rope == "linear":
            return {"rope_type": "linear", "factor": float(self.rope_factor)}
        if self.rope == "dynamic":
            return {"rope_type": "dynamic", "original_max_position_embeddings": self.chunk_tokens}
        return {"rope_type": "none"}


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
        # EAGLE-3 numbering (id j = the input of layer j = hidden_states[j]): the output of
        # layer j, which the teacher records, is id j + 1; the field marks the convention
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [j + 1 for j in config.aux_layers]},
        CONVENTION_KEY: "input",
        "specontext_variant": config.variant,
    }
    if config.rope_scaling is not None:
        head_config["rope_scaling"] = config.rope_scaling
    return tensors, head_config


def training_positions(tokens: int, config: DistillConfig, generator: torch.Generator) -> torch.Tensor:
    """Head RoPE positions of one training step, int64 ``[1, tokens]``, strictly increasing:
    ``0..tokens-1`` (``"contiguous"``); a sorted random subset of ``[0, max_position)``
    (``"random"``); or, for ``"random_span"``, a span ``S`` uniform in
    ``[tokens, max_position]``, an offset uniform in ``[0, max_position - S]`` and a sorted
    random subset of ``[offset, offset + S)`` that always holds both ends."""
    if config.positions == "contiguous":
        return torch.arange(tokens)[None]
    if config.positions == "random":
        return torch.randperm(config.max_position, generator=generator)[:tokens].sort().values[None]
    span = int(torch.randint(tokens, config.max_position + 1, (), generator=generator))
    offset = int(torch.randint(0, config.max_position - span + 1, (), generator=generator))
    inner = torch.randperm(span - 2, generator=generator)[: tokens - 2].sort().values + 1
    return (offset + torch.cat([torch.tensor([0]), inner, torch.tensor([span - 1])]))[None]


def _excluded(t: int, rows: int, config: DistillConfig) -> torch.Tensor:
    """bool ``[R, T]``: keys a query row does not rank: later tokens; and, when ``loss_sink``
    or ``loss_window`` is set, the row itself (a decode step ranks only cached tokens), the
    first ``loss_sink`` tokens and the ``loss_window`` tokens before the row."""
    key = torch.arange(t)[None, :]
    row = torch.arange(t - rows, t)[:, None]
    out = key > row
    if config.loss_sink or config.loss_window:
        out = out | (key < config.loss_sink) | (key >= row - config.loss_window)
    return out


def _loss(head: Eagle3RetrievalHead, batch: TeacherBatch, config: DistillConfig,
          positions: torch.Tensor) -> torch.Tensor:
    """KL(teacher || head) averaged over KV heads and query rows, over the keys each row ranks.

    ``positions`` ``[1, T]`` are the head's RoPE positions for this step.
    """
    t, rows = batch.input_ids.shape[1], batch.teacher.shape[1]
    aux = batch.aux_hidden if config.variant == "fused" else torch.zeros_like(batch.aux_hidden)
    q, k = head(batch.input_ids, aux, positions)
    logits = query_key_logits(q[0, :, -rows:], k[0], head.head_dim**-0.5)  # [kv, R, T], fp16-safe
    excluded = _excluded(t, rows, config)
    logp = torch.log_softmax(logits.masked_fill(excluded, float("-inf")), -1)
    teacher = batch.teacher.masked_fill(excluded, 0.0)
    teacher = teacher / teacher.sum(-1, keepdim=True).clamp_min(1e-12)
    return (teacher * (teacher.clamp_min(1e-12).log() - logp.masked_fill(excluded, 0.0))).sum(-1).mean()


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
    gen = torch.Generator().manual_seed(config.seed)
    losses = []
    for step in range(config.steps):
        batch = batches[step % len(batches)]
        positions = training_positions(batch.input_ids.shape[1], config, gen)
        loss = _loss(head, batch, config, positions)
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
    """Split tokenised texts into ``[1, chunk_tokens]`` chunks (at most ``max_chunks``),
    taken round-robin over the texts (the first chunk of every text, then the second, ...)
    so that a few long texts do not crowd out the others."""
    per_text = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        per_text.append([ids[:, s : s + chunk_tokens] for s in range(0, ids.shape[1] - chunk_tokens + 1, chunk_tokens)])
    out = []
    for i in range(max((len(c) for c in per_text), default=0)):
        for chunks in per_text:
            if i < len(chunks):
                out.append(chunks[i])
                if len(out) >= max_chunks:
                    return out
    return out


def _load_teacher(path: Path, key: dict) -> list[TeacherBatch] | None:
    """The cached teacher batches of ``path`` when its key matches ``key``, else None."""
    if not Path(path).is_file():
        return None
    saved = torch.load(path, weights_only=True)
    if saved.get("key") != key:
        logger.info("teacher cache %s was made from other chunks or settings: recomputing", path)
        return None
    logger.info("teacher targets read from %s", path)
    return [TeacherBatch(**b) for b in saved["batches"]]


def distill(model, tokenizer, texts: list[str], config: DistillConfig, out_dir: Path,
            progress_factory=None, extra_meta: dict | None = None, teacher_cache: Path | None = None) -> dict:
    """The whole recipe: teacher targets from ``texts``, training, and the saved head.

    ``teacher_cache``: a file for the teacher targets (most of the cost: one target forward
    per chunk). Reused when it holds the same chunks, rows and auxiliary layers, else
    (re)written, so training both variants or several position schemes pays the teacher once.

    Returns the training record written into the head's ``config.json``
    (chunks, tokens, first/last loss, settings).

    Raises:
        ValueError: when the texts give no full chunk.
    """
    chunks = chunks_from_texts(tokenizer, texts, config.chunk_tokens, config.max_chunks)
    if not chunks:
        raise ValueError(f"the training texts hold fewer than {config.chunk_tokens} tokens")
    key = {"chunk_tokens": config.chunk_tokens, "query_rows": config.query_rows,
           "aux_layers": list(config.aux_layers), "ids": torch.cat(chunks).tolist()}
    batches = _load_teacher(teacher_cache, key) if teacher_cache is not None else None
    if batches is None:
        bar = progress_factory(len(chunks), "teacher") if progress_factory else None
        batches = []
        for chunk in chunks:
            batches.append(teacher_batch(model, chunk, config))
            if bar is not None:
                bar.update(1)
        if teacher_cache is not None:
            torch.save({"key": key, "batches": [dataclasses.asdict(b) for b in batches]}, teacher_cache)
            logger.info("teacher targets of %d chunks saved to %s", len(batches), teacher_cache)
    bar = progress_factory(config.steps, "train") if progress_factory else None
    head, head_config, losses = train_head(model, batches, config, bar)
    window = max(1, len(losses) // 10)
    meta = {
        **dataclasses.asdict(config), "rope_scaling": config.rope_scaling, "chunks": len(chunks),
        "tokens": len(chunks) * config.chunk_tokens,
        "loss_first": sum(losses[:window]) / window, "loss_last": sum(losses[-window:]) / window,
        **(extra_meta or {}),
    }
    save_head(head, head_config, out_dir, meta)
    return meta
