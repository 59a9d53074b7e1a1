"""The draft retrieval head as the backend's selection (SpeContext, arXiv 2512.00722, §4).

The paper's retrieval head is a pruned EAGLE-3 draft attention
(:class:`~specontext_compile.runtime.eagle3.Eagle3RetrievalHead`): queries and keys of
``[token embedding ++ fused auxiliary hidden states]`` with RoPE. With the backend option
``retrieval_head=DIR`` the selection node scores past tokens with that head instead of the
training-free lagged-query head (:mod:`.retrieval`). This module holds what that needs besides
the ops (``specontext::draft_anchor``, ``draft_step`` in :mod:`.ops`) and the step
functions the pass calls directly (:func:`.scorers.head_select`, ``record_hidden``):

* :func:`head_spec` reads and checks a head folder (``config.json`` + ``model.safetensors``);
* :class:`DraftKeyCache`, the head's **own key cache** ``[batch, head_kv_heads, capacity,
  head_dim]`` (one per :class:`~specontext_compile.runtime.kv_cache.SpeContextCache`), plus
  ``length``: how many positions ``0 .. length-1`` hold the head's K;
* :func:`load_head`, the loaded head per (folder, target embedding, dtype, device);
* :func:`map_to_target_heads`, the head's scores mapped to the target's KV heads (the scorer
  itself: :func:`.scorers.draft_score`).

Both variants run. **Embedding-only** heads (``specontext_variant: "embedding"`` in
``config.json``, as ``specontext distill --variant embedding`` writes them) get zero
auxiliary hidden states. **Fused** heads (a real EAGLE-3 draft, or ``--variant fused``) get,
for each token, the target's hidden states of the *previous* token named by the checkpoint's
``eagle_aux_hidden_state_layer_ids``, concatenated in that order; the first token of a fresh
cache gets zeros. The backend records the last token's ones after each step
(:func:`.aten_step.record_hidden`) for the next step.

Auxiliary id convention (details: :mod:`.eagle3`, :class:`~.eagle3.AuxLayers`): id ``j`` is the
hidden state at the *input* of decoder layer ``j``, Hugging Face ``hidden_states[j]`` (the
EAGLE-3 reference capture), read as the output of layer ``j - 1``; id ``L`` (a target of ``L``
layers) is the last layer's output *before* the final norm (Hugging Face's ``hidden_states[L]``
has the norm applied). A checkpoint without ids (the original EAGLE-3 layout) reads the
EAGLE-3 default ``(2, L // 2, L - 3)``, resolved by :meth:`HeadSpec.aux_layers_for` where the
target's layer count is known (the rewrite pass: the decoder layers of the traced graph).
Heads written by :mod:`.distill` before ``specontext_aux_convention`` existed (the shipped ones)
name layer *outputs* (id ``j`` = ``hidden_states[j + 1]``) and are read as such, unchanged.

KV-head mapping (the head's KV heads ``Hd`` vs the target's ``Ht``), on the per-head scores
``softmax(q . K * head_dim**-0.5)`` max over the query heads of each head KV group (the
paper's GQA rule, :func:`~specontext_compile.runtime.retrieval.group_max_softmax`):

* ``Hd == Ht``: head KV head ``i`` scores target KV head ``i``;
* ``Hd == 1`` or ``Ht % Hd == 0``: head KV head ``i`` scores target KV heads
  ``i*Ht/Hd .. (i+1)*Ht/Hd - 1`` (broadcast to all of them when ``Hd == 1``);
* ``Hd % Ht == 0``: target KV head ``j`` takes the element-wise max over head KV heads
  ``j*Hd/Ht .. (j+1)*Hd/Ht - 1``;
* otherwise: the max over all head KV heads, broadcast to every target KV head.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import torch

from .eagle3 import AuxLayers, read_aux_layers
from .rollback import ROLLBACK_TOKENS

logger = logging.getLogger(__name__)

__all__ = ["DraftKeyCache", "HeadSpec", "head_spec", "load_head", "previous_hidden",
           "map_to_target_heads", "normalize_head_path"]

_LOADED: dict[tuple, torch.nn.Module] = {}  # filled on use, never at import
_MAX_LOADED = 8


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """What the backend needs to know about a head folder before loading its weights.

    Attributes:
        path: the resolved folder (str; the identity used in graphs and caches).
        num_heads, num_kv_heads, head_dim, hidden: the head's attention shapes.
        vocab_size: the target vocabulary the head embeds (``None`` when not stated).
        has_embedding: whether ``model.safetensors`` holds ``embed_tokens.weight`` (else
            the target's token embedding is used, and must be ``hidden`` wide).
        variant: ``"embedding"`` or ``"fused"``.
        aux_layer_ids: 0-based decoder layers whose outputs a fused head reads, in order
            (an EAGLE-3 id ``j`` is layer ``j - 1`` here); ``()`` when the checkpoint names
            none (the EAGLE-3 default, resolved by :meth:`aux_layers_for`).
        aux_width: width of the auxiliary input (``fc.weight``'s columns, ``3 * target
            hidden`` for EAGLE-3).
        stamp: modification times (ns) of ``config.json`` and ``model.safetensors`` when
            read; a rewritten head is read (and loaded) again.
    """

    path: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    vocab_size: int | None
    has_embedding: bool
    variant: str
    aux_layer_ids: tuple[int, ...] = ()
    aux_width: int = 0
    stamp: tuple[int, ...] = ()
    aux: AuxLayers = dataclasses.field(default_factory=AuxLayers)

    def aux_layers_for(self, num_layers: int) -> tuple[int, ...]:
        """The 0-based decoder layers whose outputs feed a fused head on a target of
        ``num_layers`` decoder layers (the default resolved, the ids' range checked).

        Raises:
            ValueError: see :meth:`~.eagle3.AuxLayers.layer_outputs`.
        """
        return self.aux.layer_outputs(num_layers)

    def describe(self) -> str:
        kind = "embedding-only" if self.variant == "embedding" else f"fused, {self.aux.describe()}"
        return (f"draft head {self.path} ({kind}, EAGLE-3 layout, {self.num_heads} heads / "
                f"{self.num_kv_heads} KV heads, head_dim {self.head_dim})")


def normalize_head_path(path: str | os.PathLike) -> str:
    """The resolved absolute folder, as a str (what graphs and caches compare). A name of a
    head shipped in the package (``specontext_compile.runtime.heads.available()``, e.g.
    ``"smollm2-135m-fused"``) that is not also a folder here stands for that head's folder."""
    folder = Path(path).expanduser()
    if not folder.exists() and isinstance(path, str):
        from .heads import available, path_of

        if path in available():
            folder = path_of(path)
    return str(folder.resolve())


def _shipped() -> list[str]:
    from .heads import available

    return available()


_SPECS: dict[tuple, HeadSpec] = {}


def head_spec(path: str | os.PathLike) -> HeadSpec:
    """Read and check the head folder ``path``.

    Raises:
        ValueError: the folder or one of ``config.json`` / ``model.safetensors`` is missing,
            the config is not an EAGLE-3 one, its auxiliary ids are malformed, or it is a
            specontext head of no usable variant (a fused one without auxiliary ids); the
            message says what to do instead. A checkpoint without ``specontext_variant`` and
            without ids is an original-layout EAGLE-3 draft: accepted, with the default
            layers (:meth:`HeadSpec.aux_layers_for`).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"specontext option 'retrieval_head' must be a folder path (str), got {path!r}")
    folder = Path(normalize_head_path(path))
    if not folder.is_dir():
        raise ValueError(
            f"specontext option 'retrieval_head': {folder} is not a folder; pass the folder written by "
            "`specontext distill` (config.json + model.safetensors), the name of a shipped head "
            f"({', '.join(_shipped())}), or leave it unset for the lagged-query head")
    for name in ("config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise ValueError(
                f"specontext option 'retrieval_head': {folder} holds no {name}; a retrieval head folder "
                "needs config.json and model.safetensors in the EAGLE-3 layout (write one with "
                "`specontext distill --variant embedding`)")
    stamp = tuple((folder / n).stat().st_mtime_ns for n in ("config.json", "model.safetensors"))
    key = (str(folder), stamp)
    if key in _SPECS:
        return _SPECS[key]
    try:
        config = json.loads((folder / "config.json").read_text())
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"specontext option 'retrieval_head': {folder / 'config.json'} is not an "
                         f"EAGLE-3 config ({err!r})") from err
    variant = config.get("specontext_variant") or "fused"
    try:
        aux = read_aux_layers(config)
    except ValueError as err:
        raise ValueError(f"specontext option 'retrieval_head': {folder / 'config.json'}: {err}") from err
    # a head of specontext's own always names its layers; only an EAGLE-3 draft (no
    # specontext_variant) may leave them to the EAGLE-3 default
    ours = "specontext_variant" in config
    if variant not in ("embedding", "fused") or (variant == "fused" and ours and aux.is_default):
        raise ValueError(
            f"specontext option 'retrieval_head': {folder / 'config.json'} names no usable variant "
            f"({variant!r}, auxiliary layers {list(aux.ids)}); a fused head needs "
            "eagle_aux_hidden_state_layer_ids, an embedding-only one 'specontext_variant': 'embedding' "
            "(an EAGLE-3 draft without specontext_variant and without ids reads the default layers "
            "(2, L//2, L-3))")
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        if "fc.weight" not in names:
            raise ValueError(f"specontext option 'retrieval_head': {folder} has no fc.weight "
                             "(not an EAGLE-3 head checkpoint)")
        aux_width = int(f.get_slice("fc.weight").get_shape()[1])
    has_embedding = "embed_tokens.weight" in names
    spec = HeadSpec(
        path=str(folder), num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads), hidden=hidden,
        vocab_size=config.get("vocab_size"), has_embedding=has_embedding, variant=variant,
        aux_layer_ids=aux.known_layer_outputs, aux_width=aux_width, stamp=stamp, aux=aux,
    )
    if variant == "fused" and aux.is_default:
        logger.info("specontext: %s names no auxiliary layers: the EAGLE-3 default (2, L//2, L-3) "
                    "is used, L = the target's decoder layers", folder / "config.json")
    _SPECS[key] = spec
    return spec


def load_head(path: str, embedding: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The :class:`~specontext_compile.runtime.eagle3.Eagle3RetrievalHead` of ``path`` in
    ``dtype`` on ``device``; ``embedding`` (the target's ``[vocab, hidden]`` token embedding)
    is used when the checkpoint has none. Loaded once per (folder, files' mtimes, embedding
    storage, dtype, device); at most 8 are kept.

    Raises:
        ValueError: see :func:`head_spec` and
            :func:`~specontext_compile.runtime.eagle3.load_eagle3_head`.
    """
    from .eagle3 import load_eagle3_head

    spec = head_spec(path)
    folder = Path(spec.path)
    emb_key = None if spec.has_embedding else (embedding.data_ptr(), tuple(embedding.shape), embedding.dtype)
    key = (spec.path, spec.stamp, emb_key, dtype, str(device))
    head = _LOADED.get(key)
    if head is None:
        head, _ = load_eagle3_head(folder, None if spec.has_embedding else embedding.detach())
        head = head.to(device=device, dtype=dtype)
        if len(_LOADED) >= _MAX_LOADED:
            _LOADED.pop(next(iter(_LOADED)))
        _LOADED[key] = head
        logger.info("specontext: loaded %s", spec.describe())
    return head


def map_to_target_heads(scores: torch.Tensor, target_kv_heads: int) -> torch.Tensor:
    """Map ``[batch, head_kv_heads, n]`` scores to ``[batch, target_kv_heads, n]`` (rules in
    the module docstring)."""
    b, hd, n = scores.shape
    ht = target_kv_heads
    if hd == ht:
        return scores
    if ht % hd == 0:
        return scores.repeat_interleave(ht // hd, dim=1)
    if hd % ht == 0:
        return scores.view(b, ht, hd // ht, n).amax(dim=2)
    return scores.amax(dim=1, keepdim=True).expand(b, ht, n)


def previous_hidden(aux_state: torch.Tensor, aux_valid: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """A fused head's auxiliary input for the token at position ``start`` (int64 scalar: the
    tokens cached before the step): the recorded hidden states of position ``start - 1``,
    ``[batch, 1, aux_width]``: row 0 when the last step ended there, else its history row
    when that is stamped ``start`` (recorded for that
    very position and not forgotten by a crop); zeros otherwise (the first token, a crop deeper
    than the history, a step run without the backend). ``aux_state``/``aux_valid`` as in
    :class:`DraftKeyCache`. No host read."""
    entry = (1 + (start - 1) % (aux_state.shape[1] - 1)).view(1)
    current = (aux_valid[:1] == start) & (start > 0)  # row 0: the last step's last row
    recorded = (aux_valid.index_select(0, entry) == start) & (start > 0)
    return torch.where(current, aux_state[:, :1], aux_state.index_select(1, entry) * recorded.to(aux_state.dtype))


class DraftKeyCache:
    """The draft head's key cache, owned by a ``SpeContextCache`` built with ``retrieval_head``.

    ``keys``: ``[batch, head_kv_heads, capacity, head_dim]`` in the target's dtype (allocated
    at the first layer-0 update, capacity = the target's layer-0 store). ``length``: int64
    scalar; positions ``0 .. length-1`` hold the head's K (written by
    ``specontext::draft_step`` in compiled graphs only). When a step is run without the
    backend (eager prefill of Hugging Face's compile path), its tokens get no K: ``length``
    then stays behind the target's and every later selection falls back to the most recent
    tokens (``path_counts()["recency_fallback_steps"]``); it is never scored from unwritten slots.
    ``aux_state`` ``[batch, 1 + ROLLBACK_TOKENS, aux_width]`` and ``aux_valid`` (int64
    ``[1 + ROLLBACK_TOKENS]``): the auxiliary hidden states (fused heads; unused otherwise) of
    the last token in row 0 (what the next step reads) and of the last ``ROLLBACK_TOKENS``
    positions, position ``p`` in row ``1 + p % ROLLBACK_TOKENS``, each stamped ``p + 1`` (0:
    empty), written by :func:`.aten_step.record_hidden` and read by
    :func:`previous_hidden`: after a rollback (:meth:`crop`) of up to ``ROLLBACK_TOKENS``
    tokens the next step reads the kept token's hidden states, as a fresh cache fed the kept
    tokens would (issue 52).

    Args:
        spec: the head (see :func:`head_spec`).
    """

    def __init__(self, spec: HeadSpec):
        self.spec = spec
        self.head = spec.path  # str: stays a graph constant on the draft anchor
        self.keys: torch.Tensor | None = None
        self.length = torch.zeros((), dtype=torch.long)
        self.aux_state: torch.Tensor | None = None
        self.aux_valid = torch.zeros(1 + ROLLBACK_TOKENS, dtype=torch.long)

    def prepare(self, like: torch.Tensor, capacity: int, compiling: bool) -> None:
        """Allocate (first use, or a new batch size) or grow (eager only) the store so it
        holds ``capacity`` positions; ``like`` is the target's layer-0 key states."""
        b = like.shape[0]
        if self.keys is None or self.keys.shape[0] != b:
            self.keys = like.new_zeros((b, self.spec.num_kv_heads, capacity, self.spec.head_dim))
            self.length = torch.zeros((), dtype=torch.long, device=like.device)
            self.aux_state = like.new_zeros((b, 1 + ROLLBACK_TOKENS, max(1, self.spec.aux_width)))
            self.aux_valid = torch.zeros(1 + ROLLBACK_TOKENS, dtype=torch.long, device=like.device)
        elif not compiling and self.keys.shape[2] < capacity:
            new = self.keys.new_zeros((*self.keys.shape[:2], capacity, self.keys.shape[-1]))
            new[:, :, : self.keys.shape[2]].copy_(self.keys)
            self.keys = new

    def reset(self) -> None:
        """Forget every position and the recorded hidden states (the stores are kept and
        zeroed, as a fresh cache's)."""
        self.length.zero_()
        self.aux_valid.zero_()
        if self.keys is not None:
            self.keys.zero_()
            self.aux_state.zero_()

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row ``i`` of ``keys`` and ``aux_state`` becomes old row
        ``beam_idx[i]`` (int64 ``[batch]``, checked by the cache), in place; ``length`` and
        ``aux_valid`` are shared by the rows."""
        if self.keys is None:
            return
        idx = beam_idx.to(self.keys.device)
        self.keys.copy_(self.keys.index_select(0, idx))
        self.aux_state.copy_(self.aux_state.index_select(0, idx))

    def select_rows(self, idx: torch.Tensor) -> None:
        """Keep rows ``idx`` (int64 ``[new_batch]``, repeats allowed) of ``keys`` and
        ``aux_state`` (new tensors: the batch size changes)."""
        if self.keys is None:
            return
        idx = idx.to(self.keys.device)
        self.keys = self.keys.index_select(0, idx)
        self.aux_state = self.aux_state.index_select(0, idx)

    def crop(self, new_length: int) -> None:
        """The target cache now holds ``new_length`` tokens: positions ``>= new_length`` are
        forgotten (``length = min(length, new_length)``, their keys zeroed; a length that lags
        behind the target's stays behind), and so are their recorded hidden states; the kept
        positions' stay, so the next step reads the last kept token's (as a fresh cache fed the
        kept tokens would), unless the crop went deeper than ``ROLLBACK_TOKENS``: then its
        head input is zeros, as the first token of a fresh cache's."""
        if self.keys is None:
            return
        old = int(self.length)
        if new_length < old:
            self.keys[:, :, new_length:old].zero_()
            self.length.fill_(new_length)
        self.aux_valid.masked_fill_(self.aux_valid > new_length, 0)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.numel() * self.keys.element_size()
