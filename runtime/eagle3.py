"""Import an EAGLE-3 draft checkpoint and prune it to a retrieval head (SpeContext §4).

SpeContext (arXiv 2512.00722, section 4) keeps only what produces the draft model's
attention weights: the token embedding, the fusion of the target's auxiliary hidden states
(``fc``), the two input norms and the Q/K projections with RoPE. Value/output projections,
the MLP, the final norm, the LM head and the vocabulary maps (``d2t``, ``t2d``) are dropped
(the paper: >90% of the draft's parameters).

EAGLE-3 layout read here: ``config.json`` (Llama-style fields plus ``draft_vocab_size`` and,
optionally, the auxiliary layer ids ``eagle_aux_hidden_state_layer_ids``, top level or under
``eagle_config``) and ``model.safetensors`` with ``fc.weight`` ``[hidden, 3*target_hidden]``,
``midlayer.input_layernorm.weight``, ``midlayer.hidden_norm.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight`` (Q/K/V take ``embedding ++ fused hidden``,
``2*hidden`` wide), ``midlayer.post_attention_layernorm.weight``, ``midlayer.mlp.*``,
``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d`` and optionally ``embed_tokens.weight``.

Auxiliary layer ids (``eagle_aux_hidden_state_layer_ids``), see :class:`AuxLayers`:

* **Convention.** Id ``j`` names the hidden state at the *input* of decoder layer ``j``: Hugging
  Face ``hidden_states[j]``, i.e. the output of layer ``j - 1`` (the EAGLE-3 reference capture,
  as in the original EAGLE-3 code, vLLM and SGLang, which record the residual stream before
  layer ``j`` runs). Internally the backend reads decoder-layer *outputs*, so id ``j`` is read
  as the output of layer ``j - 1`` (:attr:`AuxLayers.layer_outputs`).
* **Boundary id.** ``j == L`` (a target of ``L`` decoder layers) is the output of the last
  layer: the residual stream *before* the model's final norm (the input a layer ``L`` would
  get). Hugging Face's ``hidden_states[L]`` is that state with the final norm applied.
* **No ids** (the original EAGLE-3 layout): the EAGLE-3 default ``(2, L // 2, L - 3)`` in the
  same input convention, resolved once the target's layer count is known
  (:meth:`AuxLayers.layer_outputs` with ``num_layers``; the backend's rewrite pass gives it the
  number of decoder layers of the traced graph).
* **Id 0** (the token embeddings, ``hidden_states[0]``) is refused: the backend reads
  decoder-layer outputs only.
* **Heads of specontext's own** (:mod:`.distill`) name the convention in ``config.json``:
  ``"specontext_aux_convention": "input"`` (written from now on, with ids in the convention
  above) or ``"output"`` (id ``j`` = the output of layer ``j``, ``hidden_states[j + 1]``). A
  config with ``specontext_variant`` but no ``specontext_aux_convention`` was written before
  the field existed (the shipped heads in :mod:`.heads` among them) and uses ``"output"``;
  any other config (a real EAGLE-3 draft) uses ``"input"``.

Position handling (ours, for heads distilled by :mod:`.distill`): an optional
``rope_scaling`` entry in ``config.json`` (see :func:`rope_positions`) stretches or removes the
head's RoPE so a head trained on short chunks can run on longer contexts. Absent or
``{"rope_type": "default"}`` means plain RoPE at the true positions, as in EAGLE-3.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = ["AUX_CONVENTIONS", "CONVENTION_KEY", "ROPE_TYPES", "AuxLayers", "Eagle3RetrievalHead", "PruneReport",
           "default_aux_layers", "load_eagle3_head", "read_aux_layers", "rope_positions", "validate_rope_scaling"]

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


AUX_CONVENTIONS = ("input", "output")
CONVENTION_KEY = "specontext_aux_convention"


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The EAGLE-3 default auxiliary ids ``(2, L // 2, L - 3)`` for a target of ``num_layers``
    decoder layers, in the input convention (id ``j`` = the input of layer ``j``)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclasses.dataclass(frozen=True)
class AuxLayers:
    """The auxiliary hidden states a fused head reads, as its ``config.json`` names them.

    Attributes:
        ids: the ids as stored (``eagle_aux_hidden_state_layer_ids``); empty = the EAGLE-3
            default :func:`default_aux_layers` (resolved with the target's layer count).
        convention: ``"input"`` (id ``j`` = the input of decoder layer ``j``, Hugging Face
            ``hidden_states[j]``; EAGLE-3) or ``"output"`` (id ``j`` = the output of layer
            ``j``, ``hidden_states[j + 1]``; specontext heads written before the convention
            was recorded). See the module docstring.
    """

    ids: tuple[int, ...] = ()
    convention: str = "input"

    @property
    def is_default(self) -> bool:
        """Whether the checkpoint names no ids (the EAGLE-3 default applies)."""
        return not self.ids

    @property
    def known_layer_outputs(self) -> tuple[int, ...]:
        """0-based decoder layers whose outputs are read, as far as known without the target:
        ``()`` for the default (which needs the layer count; see :meth:`layer_outputs`)."""
        shift = 1 if self.convention == "input" else 0
        return tuple(j - shift for j in self.ids)

    def describe(self) -> str:
        """One line: the ids, their convention and the layers whose outputs are read."""
        if self.is_default:
            return "aux ids: EAGLE-3 default (2, L//2, L-3), inputs of those layers"
        return (f"aux ids {list(self.ids)} ({self.convention} convention: outputs of layers "
                f"{list(self.known_layer_outputs)})")

    def layer_outputs(self, num_layers: int) -> tuple[int, ...]:
        """The 0-based decoder layers whose outputs (residual stream after the layer, before
        the final norm; ``[batch, seq, target_hidden]`` each) feed the head, in order, for a
        target of ``num_layers`` decoder layers.

        Raises:
            ValueError: an id outside the target's range (``1 .. L`` in the input convention,
                ``0 .. L-1`` in the output one), or a target too shallow for the default
                (fewer than 4 layers); the message names the ids and the fix.
        """
        if num_layers < 1:
            raise ValueError(f"the target has {num_layers} decoder layers")
        if self.is_default:
            ids = default_aux_layers(num_layers)
            if min(ids) < 1:
                raise ValueError(
                    f"the checkpoint names no auxiliary layers and the EAGLE-3 default (2, L//2, L-3) "
                    f"= {ids} needs a target of at least 4 decoder layers, this one has {num_layers}: "
                    "set eagle_aux_hidden_state_layer_ids in config.json")
            return tuple(j - 1 for j in ids)
        low, high = (1, num_layers) if self.convention == "input" else (0, num_layers - 1)
        bad = [j for j in self.ids if not low <= j <= high]
        if bad:
            meaning = ("id j = the input of decoder layer j, id L the last layer's output"
                       if self.convention == "input" else "id j = the output of decoder layer j")
            raise ValueError(
                f"auxiliary ids {bad} are outside {low}..{high} for a target of {num_layers} decoder "
                f"layers ({self.convention} convention: {meaning}); fix eagle_aux_hidden_state_layer_ids "
                "in config.json (or the head was made for another model)")
        return self.known_layer_outputs


def read_aux_layers(config: dict) -> AuxLayers:
    """The auxiliary ids of a head's ``config.json`` (top level or under ``eagle_config``)
    and their convention (rules in the module docstring).

    Raises:
        ValueError: ids that are not non-negative integers, id 0 in the input convention (the
            token embeddings), or an unknown ``specontext_aux_convention``.
    """
    nested = config.get("eagle_config") or {}
    raw = config.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids") or ()
    if not isinstance(raw, (list, tuple)) or not all(isinstance(j, int) and not isinstance(j, bool) and j >= 0
                                                      for j in raw):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids must be a list of layer ids >= 0, got {raw!r}")
    default = "output" if "specontext_variant" in config else "input"
    convention = config.get(CONVENTION_KEY, default)
    if convention not in AUX_CONVENTIONS:
        raise ValueError(f"{CONVENTION_KEY} must be one of {AUX_CONVENTIONS}, got {convention!r}")
    if convention == "input" and 0 in raw:
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids {list(raw)} holds id 0, the token embeddings (input of "
            "layer 0): not supported, the backend reads decoder-layer outputs; use ids 1..L (id j = "
            "the input of decoder layer j)")
    return AuxLayers(tuple(raw), convention)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


ROPE_TYPES = ("default", "linear", "dynamic", "none")


def validate_rope_scaling(rope_scaling: dict | None) -> dict | None:
    """Check a ``rope_scaling`` entry; returns it unchanged (None = plain RoPE).

    Accepted forms:

    * ``{"rope_type": "default"}`` — plain RoPE at the true positions.
    * ``{"rope_type": "linear", "factor": f}`` — position interpolation: positions divided by
      ``f >= 1`` at training and inference alike (the head's RoPE wavelengths are ``f`` times
      longer, so ``f`` times the training length stays inside the angles it was trained on).
    * ``{"rope_type": "dynamic", "original_max_position_embeddings": L}`` — untouched up to
      ``L`` positions, beyond that positions scaled by ``L / (max position + 1)`` so the
      furthest key is at most ``L`` away (training-free stretch of a head trained on ``L``).
    * ``{"rope_type": "none"}`` — no RoPE at all (content-only attention; recency is left to
      the selection's recent window).

    Raises:
        ValueError: an unknown ``rope_type`` or a missing / out-of-range parameter.
    """
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, dict):
        raise ValueError(f"rope_scaling must be a dict or None, got {type(rope_scaling).__name__}")
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling rope_type must be one of {ROPE_TYPES}, got {kind!r}")
    factor = rope_scaling.get("factor")
    if kind == "linear" and not (isinstance(factor, (int, float)) and factor >= 1.0):
        raise ValueError(f"linear rope_scaling needs a number factor >= 1, got {factor!r}")
    original = rope_scaling.get("original_max_position_embeddings")
    if kind == "dynamic" and not (isinstance(original, int) and original >= 1):
        raise ValueError(f"dynamic rope_scaling needs an integer original_max_position_embeddings >= 1, "
                         f"got {original!r}")
    return rope_scaling


def rope_positions(positions: torch.Tensor, rope_scaling: dict | None) -> torch.Tensor | None:
    """Float positions fed to RoPE under ``rope_scaling`` (None when RoPE is off).

    Args:
        positions: int64 ``[batch, seq]`` true token positions (0-based).
        rope_scaling: a dict accepted by :func:`validate_rope_scaling`, or None.

    Returns:
        float32 ``[batch, seq]`` positions, or None for ``rope_type == "none"``.
    """
    pos = positions.float()
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if kind == "none":
        return None
    if kind == "linear":
        return pos / float(rope_scaling["factor"])
    if kind == "dynamic":
        original = int(rope_scaling["original_max_position_embeddings"])
        span = float(positions.max()) + 1.0 if positions.numel() else 0.0
        return pos * (original / span) if span > original else pos
    return pos


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE (rotate-half convention) of ``x`` ``[batch, heads, seq, head_dim]`` at (possibly
    fractional) ``positions`` ``[batch, seq]``."""
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
        num_layers: the target's decoder layers; resolves the EAGLE-3 default auxiliary layers
            of a checkpoint without ids and checks the ids' range (None: not checked, and
            ``aux_layer_ids`` stays ``()`` for such a checkpoint).

    Attributes:
        aux: the ids as stored and their convention (:class:`AuxLayers`).
        aux_layer_ids: 0-based decoder layers whose *outputs* feed ``aux_hidden`` (Hugging
            Face ``hidden_states[j + 1]``; the last layer's before the final norm), in order;
            an EAGLE-3 id ``j`` is layer ``j - 1`` here.

    Raises:
        ValueError: a missing or mis-shaped tensor (named), no embedding at all, or bad
            auxiliary ids (see :func:`read_aux_layers`, :meth:`AuxLayers.layer_outputs`).
    """

    def __init__(self, config: dict, tensors: dict[str, torch.Tensor],
                 target_embedding: torch.Tensor | None = None, num_layers: int | None = None):
        super().__init__()
        self.hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads", self.num_heads)
        self.head_dim = config.get("head_dim") or self.hidden // self.num_heads
        self.eps = config.get("rms_norm_eps", 1e-6)
        self.rope_theta = config.get("rope_theta", 10000.0)
        self.rope_scaling = validate_rope_scaling(config.get("rope_scaling"))
        self.aux = read_aux_layers(config)
        self.aux_layer_ids = (self.aux.known_layer_outputs if num_layers is None
                              else self.aux.layer_outputs(num_layers))
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
                states (the outputs of layers ``aux_layer_ids``, concatenated in that order) of
                the *previous* step's tokens.
            positions: int64 ``[batch, seq]`` true positions (``rope_scaling`` is applied here).

        Returns:
            ``(query [batch, num_heads, seq, head_dim], key [batch, num_kv_heads, seq, head_dim])``.
        """
        b, s = input_ids.shape
        emb = _rms_norm(torch.nn.functional.embedding(input_ids, self.embedding), self.input_norm, self.eps)
        fused = _rms_norm(aux_hidden @ self.fc.T, self.hidden_norm, self.eps)
        x = torch.cat([emb, fused], dim=-1)
        q = (x @ self.q_proj.T).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = (x @ self.k_proj.T).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        pos = rope_positions(positions, self.rope_scaling)
        if pos is None:
            return q, k
        return _rotate(q, pos, self.rope_theta), _rotate(k, pos, self.rope_theta)


def load_eagle3_head(path: str | Path, target_embedding: torch.Tensor | None = None,
                     num_layers: int | None = None):
    """Load ``path`` (a folder with ``config.json`` and ``model.safetensors``) and prune it.

    Args:
        path: the checkpoint folder.
        target_embedding: ``[vocab, hidden]`` embedding to use when the checkpoint has none.
        num_layers: the target's decoder layers (see :class:`Eagle3RetrievalHead`).

    Returns:
        ``(Eagle3RetrievalHead, PruneReport)``.

    Raises:
        ValueError: missing files, a missing or mis-shaped tensor (named), a config
            without ``draft_vocab_size``, bad auxiliary ids.
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
    head = Eagle3RetrievalHead(config, {n: tensors[n] for n in kept_names}, target_embedding, num_layers)
    report = PruneReport(
        kept=sum(tensors[n].numel() for n in kept_names),
        total=sum(t.numel() for t in tensors.values()),
        dropped=tuple(sorted(set(tensors) - set(kept_names))),
    )
    logger.info("EAGLE-3 head: kept %d of %d parameters (%.1f%% pruned)",
                report.kept, report.total, 100 * report.pruned_fraction)
    return head, report
