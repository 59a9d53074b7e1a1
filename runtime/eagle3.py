"""Import an EAGLE-3 draft checkpoint and prune it to a retrieval head (SpeContext §4).

SpeContext (arXiv 2512.00722, section 4) keeps only what produces the draft model's
attention weights: the token embedding, the fusion of the target's auxiliary hidden states
(``fc``), the two input norms and the Q/K projections with RoPE. Value/output projections,
the MLP, the final norm, the LM head and the vocabulary maps (``d2t``, ``t2d``) are dropped
(the paper: >90% of the draft's parameters).

EAGLE-3 layout read here: ``config.json`` (Llama-style fields plus ``draft_vocab_size`` and
the auxiliary layer ids ``eagle_aux_hidden_state_layer_ids``, top level or under
``eagle_config``) and ``model.safetensors`` with ``fc.weight`` ``[hidden, 3*target_hidden]``,
``midlayer.input_layernorm.weight``, ``midlayer.hidden_norm.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight`` (Q/K/V take ``embedding ++ fused hidden``,
``2*hidden`` wide), ``midlayer.post_attention_layernorm.weight``, ``midlayer.mlp.*``,
``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d`` and optionally ``embed_tokens.weight``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = ["Eagle3RetrievalHead", "PruneReport", "load_eagle3_head"]

KEPT = ("fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
        "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight")
OPTIONAL = ("embed_tokens.weight",)


@dataclasses.dataclass(frozen=True)
class PruneReport:
    """Parameters kept for the retrieval head vs the whole draft checkpoint (counts)."""

    kept: int
    total: int
    dropped: tuple[str, ...]

    @property
    def pruned_fraction(self) -> float:
        return 1.0 - self.kept / self.total


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE (rotate-half convention) of ``x`` ``[batch, heads, seq, head_dim]``."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = positions.float()[..., None] * inv_freq  # [batch, seq, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None].to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None].to(x.dtype)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


class Eagle3RetrievalHead(torch.nn.Module):
    """The pruned EAGLE-3 draft: embedding + fused hidden -> Q/K with RoPE.

    Args:
        config: the draft's ``config.json`` as a dict.
        tensors: the kept tensors (names as in :data:`KEPT`, plus optionally
            ``embed_tokens.weight``).
        target_embedding: ``[vocab, hidden]`` embedding to use when the checkpoint has none.

    Raises:
        ValueError: a missing or mis-shaped tensor (named), or no embedding at all.
    """

    def __init__(self, config: dict, tensors: dict[str, torch.Tensor],
                 target_embedding: torch.Tensor | None = None):
        super().__init__()
        self.hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads", self.num_heads)
        self.head_dim = config.get("head_dim") or self.hidden // self.num_heads
        self.eps = config.get("rms_norm_eps", 1e-6)
        self.rope_theta = config.get("rope_theta", 10000.0)
        self.aux_layer_ids = tuple(_aux_layers(config))
        embedding = tensors.get("embed_tokens.weight", target_embedding)
        if embedding is None:
            raise ValueError("the checkpoint has no embed_tokens.weight: pass target_embedding=")
        expected = {
            "fc.weight": (self.hidden, tensors["fc.weight"].shape[1]),
            "midlayer.input_layernorm.weight": (self.hidden,),
            "midlayer.hidden_norm.weight": (self.hidden,),
            "midlayer.self_attn.q_proj.weight": (self.num_heads * self.head_dim, 2 * self.hidden),
            "midlayer.self_attn.k_proj.weight": (self.num_kv_heads * self.head_dim, 2 * self.hidden),
        }
        for name, shape in expected.items():
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"EAGLE-3 tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
        if embedding.shape[1] != self.hidden:
            raise ValueError(f"embedding width {embedding.shape[1]} != draft hidden_size {self.hidden}")
        self.embedding = torch.nn.Parameter(embedding, requires_grad=False)
        self.fc = torch.nn.Parameter(tensors["fc.weight"], requires_grad=False)
        self.input_norm = torch.nn.Parameter(tensors["midlayer.input_layernorm.weight"], requires_grad=False)
        self.hidden_norm = torch.nn.Parameter(tensors["midlayer.hidden_norm.weight"], requires_grad=False)
        self.q_proj = torch.nn.Parameter(tensors["midlayer.self_attn.q_proj.weight"], requires_grad=False)
        self.k_proj = torch.nn.Parameter(tensors["midlayer.self_attn.k_proj.weight"], requires_grad=False)

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, positions: torch.Tensor):
        """Queries and keys of the draft's attention.

        Args:
            input_ids: int64 ``[batch, seq]``.
            aux_hidden: ``[batch, seq, 3 * target_hidden]``: the target's auxiliary hidden
                states (layers ``aux_layer_ids``) of the *previous* step's tokens.
            positions: int64 ``[batch, seq]``.

        Returns:
            ``(query [batch, num_heads, seq, head_dim], key [batch, num_kv_heads, seq, head_dim])``.
        """
        b, s = input_ids.shape
        emb = _rms_norm(torch.nn.functional.embedding(input_ids, self.embedding), self.input_norm, self.eps)
        fused = _rms_norm(aux_hidden @ self.fc.T, self.hidden_norm, self.eps)
        x = torch.cat([emb, fused], dim=-1)
        q = (x @ self.q_proj.T).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = (x @ self.k_proj.T).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _rotate(q, positions, self.rope_theta), _rotate(k, positions, self.rope_theta)


def _aux_layers(config: dict) -> list[int]:
    nested = config.get("eagle_config") or {}
    return list(config.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids") or [])


def load_eagle3_head(path: str | Path, target_embedding: torch.Tensor | None = None):
    """Load ``path`` (a folder with ``config.json`` and ``model.safetensors``) and prune it.

    Returns:
        ``(Eagle3RetrievalHead, PruneReport)``.

    Raises:
        ValueError: missing files, a missing or mis-shaped tensor (named), a config
            without ``draft_vocab_size``.
    """
    from safetensors.torch import load_file

    folder = Path(path)
    for name in ("config.json", "model.safetensors"):
        if not (folder / name).exists():
            raise ValueError(f"{folder} is not an EAGLE-3 checkpoint: {name} is missing")
    config = json.loads((folder / "config.json").read_text())
    if "draft_vocab_size" not in config:
        raise ValueError(f"{folder / 'config.json'} has no draft_vocab_size: not an EAGLE-3 config")
    tensors = load_file(str(folder / "model.safetensors"))
    missing = [name for name in KEPT if name not in tensors]
    if missing:
        raise ValueError(f"EAGLE-3 checkpoint {folder} lacks tensor(s) {missing}")
    kept_names = [n for n in (*KEPT, *OPTIONAL) if n in tensors]
    head = Eagle3RetrievalHead(config, {n: tensors[n] for n in kept_names}, target_embedding)
    report = PruneReport(
        kept=sum(tensors[n].numel() for n in kept_names),
        total=sum(t.numel() for t in tensors.values()),
        dropped=tuple(sorted(set(tensors) - set(kept_names))),
    )
    logger.info("EAGLE-3 head: kept %d of %d parameters (%.1f%% pruned)",
                report.kept, report.total, 100 * report.pruned_fraction)
    return head, report
