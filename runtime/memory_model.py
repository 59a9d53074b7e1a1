"""The device-memory model and the adaptive offload plan (SpeContext section 6, eqs. 6-8).

The paper's model (fp16, one KV row = 2 x 2 bytes per head-dim element)::

    M_all  = 1.3 (M_O + M_D) + 4 R (L + 1 + alpha) S H D                       (eq. 6)
    M_part = 1.3 (M_O + M_D) + 4 R [(L_gpu + 1 + alpha) S + L_cpu B] H D        (eq. 7)
    ST_i   = largest S with M_part(S, L_cpu = i) <= Mem_GPU                       (eq. 8)

generalised here to

* the real element size and separate key / value widths (``head_dim_k``, ``head_dim_v``;
  for MLA pass ``num_kv_heads=1``, ``head_dim_k`` = latent + rope width, ``head_dim_v=0``);
* batch ``R`` and GQA (``H`` = KV heads, not query heads);
* the retrieval head's own KV (``draft_cache_layers``: the paper's "+1"; our lagged-query
  head reads the target's stores and keeps none, so 0 by default) and extra per-layer
  buffers (``alpha`` layers' worth of S rows, e.g. a repeat_kv expansion);
* our own buffers: a constant ``fixed_bytes`` (retrieval state, selection, and the per-page
  key bounds of the page rescue: every layer's, offloaded or not, stay on the device and are
  allocated once for the stores' capacity) and, per offloaded layer, its slot maps
  (``map_bytes_per_layer``) next to its ``B``-row buffer;
* ``activation_factor`` (the paper's 0.3, an assumption it states);
* ``resident_layers``: layers never offloaded (option ``dense_layers``: their attention reads
  the whole store every step), so ``L_cpu <= L - resident_layers``; their KV stays in the
  ``(L - L_cpu) S`` term like any layer on the device.

Every quantity is in bytes; ``S`` counts tokens in the cache after a step's write.

Thresholds are returned as the *first length that does not fit* (the paper's ST_i + 1), so
the decode-time rule is exactly ``while length >= ST[offloaded]: offload one more layer``.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import sympy

logger = logging.getLogger(__name__)

__all__ = ["MemoryModel", "DeviceMemoryError", "INF"]

INF = math.inf


class DeviceMemoryError(RuntimeError, ValueError):
    """The device tier cannot hold the model even with every layer offloaded (a
    ``ValueError`` too: raised for a ``device_memory_bytes`` option that can never work)."""


@dataclasses.dataclass(frozen=True)
class MemoryModel:
    """Byte model of one request batch on the device tier (see the module docstring).

    Attributes:
        num_layers: decoder layers ``L`` with a KV store.
        num_kv_heads: KV heads ``H`` per layer (GQA: fewer than query heads).
        head_dim_k, head_dim_v: key / value width per head (elements).
        elem_bytes: bytes per KV element (2 for fp16/bf16, 4 for fp32).
        batch: concurrent requests ``R``.
        budget: selected tokens per KV head ``B`` (rows of an offloaded layer's buffer).
        weight_bytes: ``M_O``, bytes of the model's parameters and buffers.
        draft_weight_bytes: ``M_D``, bytes of the retrieval head's own weights.
        activation_factor: activations as a share of weights (paper: 0.3).
        draft_cache_layers: layers' worth of KV the retrieval head keeps itself (paper: 1).
        alpha: extra per-layer buffers of ``S`` rows each.
        fixed_bytes: our constant device buffers (retrieval state, selection, page bounds).
        map_bytes_per_layer: slot-map bytes of each offloaded layer.
        resident_layers: layers that stay on the device at every length (never offloaded;
            ``0 <= resident_layers < num_layers``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    elem_bytes: int
    batch: int
    budget: int
    weight_bytes: int
    draft_weight_bytes: int = 0
    activation_factor: float = 0.3
    draft_cache_layers: int = 0
    alpha: float = 0.0
    fixed_bytes: int = 0
    map_bytes_per_layer: int = 0
    resident_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "elem_bytes", "batch", "budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"MemoryModel.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.resident_layers < self.num_layers:
            raise ValueError(f"MemoryModel.resident_layers must be in [0, num_layers={self.num_layers}) (at least "
                             f"one layer must be offloadable), got {self.resident_layers}")

    @property
    def offloadable(self) -> int:
        """The most layers the plan may offload: ``L - resident_layers``."""
        return self.num_layers - self.resident_layers

    # --- symbolic model -------------------------------------------------------------------
    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K and V in one layer for the whole batch: ``R H (Dk+Dv) e``."""
        return self.batch * self.num_kv_heads * (self.head_dim_k + self.head_dim_v) * self.elem_bytes

    def expression(self) -> tuple[sympy.Expr, sympy.Symbol, sympy.Symbol]:
        """``(M_part, S, L_cpu)``: device bytes as a sympy expression (eq. 7 generalised);
        ``L_cpu = 0`` gives eq. 6."""
        s, lc = sympy.symbols("S L_cpu", nonnegative=True)
        weights = sympy.Rational(str(1 + self.activation_factor)) * (self.weight_bytes + self.draft_weight_bytes)
        per_s = (self.num_layers - lc + self.draft_cache_layers + sympy.Rational(str(self.alpha))) * s
        kv = self.row_bytes * (per_s + lc * self.budget)
        return weights + self.fixed_bytes + kv + lc * self.map_bytes_per_layer, s, lc

    def device_bytes(self, tokens: int, offloaded: int) -> int:
        """Predicted device-tier bytes at ``tokens`` cached tokens with ``offloaded`` layers
        on the host (rounded up)."""
        return int(sympy.ceiling(self._compiled()(tokens, offloaded)))

    def _compiled(self):
        """The expression as an exact (rational) Python function of ``(S, L_cpu)``; built
        once per model, so the per-step check costs no symbolic substitution."""
        fn = self.__dict__.get("_fn")
        if fn is None:
            expr, s, lc = self.expression()
            poly = sympy.Poly(sympy.expand(expr), s, lc)
            terms = [(sympy.Rational(c), m) for m, c in poly.terms()]

            def fn(tokens: int, offloaded: int):
                return sum(c * sympy.Integer(tokens) ** a * sympy.Integer(offloaded) ** b
                           for c, (a, b) in terms)

            object.__setattr__(self, "_fn", fn)
        return fn

    def allocated_bytes(self, capacity: int, offloaded: int) -> int:
        """Predicted bytes of every KV allocation (host and device tier together) for stores
        of ``capacity`` tokens: all stores, the offloaded layers' ``B``-row buffers and slot
        maps, and ``fixed_bytes``. Weights and activations are not included."""
        return (self.row_bytes * (self.num_layers * capacity + offloaded * self.budget)
                + offloaded * self.map_bytes_per_layer + self.fixed_bytes)

    def thresholds(self, device_memory_bytes: int) -> list[float]:
        """``ST[i]`` for ``i = 0 .. L - resident_layers``: the first cache length (tokens) at which ``i``
        offloaded layers no longer fit in ``device_memory_bytes`` (``inf``: always fits;
        ``0``: not even an empty cache fits). Exact rational arithmetic (sympy) on
        :meth:`expression`, which is linear in ``S``: ``M_part = c_i + k_i S``, so
        ``ST[i] = floor((Mem - c_i) / k_i) + 1``, and 0 when ``c_i > Mem`` (the fixed part
        alone is too big: then ``M_part = Mem`` has no root ``S >= 0``)."""
        expr, s, lc = self.expression()
        out: list[float] = []
        for i in range(self.offloadable + 1):
            e = sympy.expand(expr.subs(lc, i))
            slope, const = e.coeff(s, 1), e.coeff(s, 0)
            if const > device_memory_bytes:
                out.append(0)
            elif slope == 0:
                out.append(INF)
            else:  # the largest S that fits is floor(root); the first that does not is one more
                out.append(int(sympy.floor((device_memory_bytes - const) / slope)) + 1)
        return out

    def minimum_device_bytes(self, tokens: int) -> int:
        """The least ``device_memory_bytes`` that holds ``tokens`` cached tokens with every
        offloadable layer offloaded (the smallest device tier the plan can work with at that
        length; the resident layers keep their ``tokens`` rows)."""
        return self.device_bytes(tokens, self.offloadable)

    def plan(self, tokens: int, offloaded: int, thresholds: list[float]) -> int:
        """Layers to keep on the host at ``tokens`` cached tokens, starting from
        ``offloaded`` (the plan only grows: while ``tokens >= ST[n]``, ``n += 1``).

        Raises:
            DeviceMemoryError: when even ``L - resident_layers`` offloaded layers do not fit.
        """
        n = offloaded
        while n < self.offloadable and tokens >= thresholds[n]:
            n += 1
        if tokens >= thresholds[n]:
            raise DeviceMemoryError(self.too_small_message(tokens))
        return n

    def too_small_message(self, tokens: int) -> str:
        """Why ``tokens`` do not fit even fully offloaded, with the minimum that would."""
        need = self.minimum_device_bytes(tokens)
        kept = (f" ({self.resident_layers} kept on the device by dense_layers: fewer dense layers need less)"
                if self.resident_layers else "")
        which = "offloadable layers" if self.resident_layers else "layers"
        return (f"the device tier cannot hold {tokens} tokens even with all {self.offloadable} {which} "
                f"offloaded{kept}: it needs at least {need} bytes ({need / 2**20:.1f} MiB: weights "
                f"x{1 + self.activation_factor:g}, {self.offloadable} buffers of budget={self.budget} "
                f"rows, own buffers); set device_memory_bytes >= {need} or lower budget")

    def describe(self, device_memory_bytes: int) -> str:
        """One line per threshold, for logs and inspection tools."""
        ths = self.thresholds(device_memory_bytes)
        parts = [f"ST[{i}]={'inf' if t == INF else int(t)}" for i, t in enumerate(ths)]
        kept = f", {self.resident_layers} layer(s) never offloaded (dense_layers)" if self.resident_layers else ""
        return (f"memory model: device {device_memory_bytes} B, weights {self.weight_bytes} B{kept}, "
                f"KV row {self.row_bytes} B/token/layer, budget {self.budget}; " + " ".join(parts))
