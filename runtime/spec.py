"""Typed, frozen options of the decode step: what it keeps (:class:`StepSpec`) and how one
attention site weighs what it keeps (:class:`AttentionVariant`).

The pass builds one :class:`StepSpec` from the config (``StepSpec.from_config``) and one
:class:`AttentionVariant` per site (from the site's constants), and hands them to the
selection, refinement and attention functions as whole values: every function reads its
options by field name, so adding an option is one field here, never a new positional
argument in a dozen signatures. Both are hashable and compare by value (the compiled step
specialises on them as on any constant), and both are registered as *value-type opaque
objects* of ``torch.library`` so that our custom ops take them as arguments and FX prints
them back as constructor calls (``__fx_repr__``).

Sources: SpeContext (arXiv 2512.00722) section 4 (budget, attention sinks, recent window,
GQA selection per KV head); Quest (arXiv 2406.10774) for the page bounds of the page
rescue.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .torch_private import opaque_base, register_opaque_type

_Opaque = opaque_base()  # torch 2.11 asks every opaque type, value types too, to be an OpaqueBase

__all__ = ["ALL_TOKENS", "KERNELS", "ROUTES", "AttentionVariant", "StepSpec", "candidate_slots"]

KERNELS = ("auto", "torch", "triton")  # sparse attention implementations (option ``kernel``)
#: what a ``specontext::sparse_attention`` site runs, decided once by the pass (:mod:`.routes`)
ROUTES = ("gather", "dense", "kernel", "offload")


def _fx_repr(value: Any) -> tuple[str, dict[str, type]]:
    """An evaluable ``Class(field=value, ...)`` and the globals it names (FX codegen)."""
    cls = type(value)
    fields = ", ".join(f"{f.name}={getattr(value, f.name)!r}" for f in dataclasses.fields(value))
    return f"{cls.__name__}({fields})", {cls.__name__: cls}


def _check_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class AttentionVariant(_Opaque):
    """How one attention site turns query-key products into weights (beyond their softmax).

    Attributes:
        scale: the logits' factor (float; Hugging Face's ``scaling``, usually ``head_dim ** -0.5``).
        soft_cap: Gemma-2's soft cap ``c`` (logits become ``c * tanh(logits / c)`` before the
            mask), or None.
        sliding_window: 0 = full causal attention; ``w > 0`` = each query row sees only the
            last ``w`` positions up to its own (Hugging Face's ``sliding_window``; not the
            selection's *recent window*).
        nope_dim: multi-head latent attention only (``qk_nope_head_dim``: the width of the
            query part absorbed into the latent space; :mod:`.mla`); 0 for other sites.
        fused_products: query-key products of a few decode rows on CPU tensors are traced as
            fused multiply-and-sum reductions instead of matmuls
            (:func:`~.sparse_attention.fused_products`). Set by the lowering
            (``passes/lower.py``) on every variant of a graph inductor compiles: data in the
            graph, where a trace-time flag used to be; False for eager code, which would
            materialise the product.

    Tensor-valued parts of a variant (learned sink logits, ALiBi's position bias) are operands
    of the functions, not fields: a spec holds constants only.

    Raises:
        ValueError: for a non-finite or non-positive ``scale``, a non-positive ``soft_cap`` or
            a negative ``sliding_window`` or ``nope_dim``.
    """

    scale: float
    soft_cap: float | None = None
    sliding_window: int = 0
    nope_dim: int = 0
    fused_products: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not 0 < self.scale < math.inf:
            raise ValueError(f"AttentionVariant.scale must be a positive finite number, got {self.scale!r}")
        object.__setattr__(self, "scale", float(self.scale))
        cap = self.soft_cap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf):
            raise ValueError(f"AttentionVariant.soft_cap must be None or a positive finite number, got {cap!r}")
        if cap is not None:
            object.__setattr__(self, "soft_cap", float(cap))
        _check_int("AttentionVariant.sliding_window", self.sliding_window, 0)
        _check_int("AttentionVariant.nope_dim", self.nope_dim, 0)
        if not isinstance(self.fused_products, bool):
            raise ValueError(f"AttentionVariant.fused_products must be True or False, got {self.fused_products!r}")

    @property
    def plain(self) -> bool:
        """True when nothing but the scale changes the softmax (no soft cap, no sliding window):
        such a site may take the dense-store shortcut and the generated kernel."""
        return self.soft_cap is None and self.sliding_window == 0

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        return _fx_repr(self)


ALL_TOKENS = 1 << 40  # candidates=inf: more slots than any store; the ops clamp it to the capacity


def candidate_slots(budget: int, candidates: float) -> int:
    """Candidate tokens per KV head the selection node picks: ``ceil(candidates * budget)``,
    at least ``budget``; :data:`ALL_TOKENS` (every cached token) for ``candidates=inf``."""
    if candidates == math.inf:
        return ALL_TOKENS
    return max(budget, math.ceil(candidates * budget))


@dataclasses.dataclass(frozen=True)
class StepSpec(_Opaque):
    """What a decode step keeps per KV head, and how (SpeContext section 4; the page rescue).

    Attributes:
        budget: tokens each layer attends to per KV head (int >= 1).
        candidate_slots: tokens the step's selection node picks per KV head (``>= budget``;
            ``== budget``: one selection shared by every layer, the paper's design; more: each
            layer refines them to its own ``budget``). Clamped to the store's capacity by the
            functions.
        sink_tokens: first visible tokens always kept (attention sinks), inside the budget.
        recent_window: last tokens always kept (the step's own tokens included), inside the
            budget; kept before the sinks when both do not fit.
        min_coverage: the fidelity guard's threshold in ``[0, 1)`` (0 = off): a refined layer
            whose kept tokens hold less of its candidates' attention mass runs dense.
        rescue_tokens: tokens of whole pages each refining layer adds to its candidates from
            the pages with the highest Quest bound under its own query (0 = off).
        page_tokens: tokens per page of the store's page bounds (0 = the store keeps none:
            no rescue). A per-store fact; :meth:`for_store` sets it.
        dense_shortcut: a selection with a slot for every store position may attend densely
            over the store (contiguous reads, exact) instead of gathering every slot.
        kernel: sparse attention implementation: ``"auto"``, ``"torch"`` or ``"triton"`` (the
            option; an input of the route decision, read by nothing else).
        offload: the KV cache may keep layers in host memory (option ``device_memory_bytes``);
            an input of the route decision, read by nothing else.
        compiled: the rewritten step is lowered to aten and compiled by inductor (options
            ``inner`` ``"auto"``/``"inductor"`` and ``lower``): only then are our CPU kernels
            taken (an eager step keeps the torch bodies, the reference the kernels are checked
            against). An input of the kernel decision (:func:`.routes.cpu_kernel`), read by
            nothing else.
        route: what this site's attention runs, one of :data:`ROUTES`, decided once per site
            by the rewrite pass (:func:`.routes.decide`) and only read after: ``"gather"``
            (the torch body over the selected positions), ``"dense"`` (exact attention over
            the whole store: the selection covers it; only its size is checked, so a
            hand-built selection of repeated positions still attends densely), ``"kernel"`` (the generated Triton
            kernel, :mod:`.kernel_step`), ``"offload"`` (the gather path on rows read through
            the offload manager: the offload schedule, ``passes/schedule.py``, moves exactly
            these sites to :func:`.offload_step.attention`; where it does not run, the gather
            path). The op, its aten body, the lowering, the kernel wrapper and the schedule
            dispatch on it and never decide again.
        cpu_kernel: our C++ CPU kernel computes this site (decided once by the pass,
            :func:`.routes.cpu_kernel`, :func:`.routes.selection_kernel`, and only read after):
            at a ``"dense"`` site :func:`.cpu_kernels.cpu_decode_attention` over the store; at
            a refined site whose refinement and attention are lowered as one body (and on its
            offloaded twin) :func:`.cpu_refine.cpu_refine_attention`; in the selection node's
            spec the lagged-query head's :func:`.cpu_selection.cpu_selection_scores`.

    Raises:
        ValueError: for a value out of range, naming the field.
    """

    budget: int
    candidate_slots: int
    sink_tokens: int = 0
    recent_window: int = 0
    min_coverage: float = 0.0
    rescue_tokens: int = 0
    page_tokens: int = 0
    dense_shortcut: bool = False
    kernel: str = "torch"
    offload: bool = False
    compiled: bool = False
    route: str = "gather"
    cpu_kernel: bool = False

    def __post_init__(self) -> None:
        _check_int("StepSpec.budget", self.budget, 1)
        _check_int("StepSpec.candidate_slots", self.candidate_slots, self.budget)
        for name in ("sink_tokens", "recent_window", "rescue_tokens", "page_tokens"):
            _check_int(f"StepSpec.{name}", getattr(self, name), 0)
        g = self.min_coverage
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 <= g < 1.0:
            raise ValueError(f"StepSpec.min_coverage must be a number in [0, 1), got {g!r}")
        object.__setattr__(self, "min_coverage", float(g))
        for name in ("dense_shortcut", "offload", "compiled", "cpu_kernel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"StepSpec.{name} must be True or False, got {getattr(self, name)!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"StepSpec.kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.route not in ROUTES:
            raise ValueError(f"StepSpec.route must be one of {ROUTES}, got {self.route!r}")

    @classmethod
    def from_config(cls, config: Any) -> StepSpec:
        """The spec of a :class:`~specontext_compile.config.SpeContextConfig` (page size unset:
        :meth:`for_store` gives each store's)."""
        select = config.selection
        return cls(budget=select.budget, candidate_slots=candidate_slots(select.budget, select.candidates),
                   sink_tokens=select.sink_tokens, recent_window=select.recent_window,
                   min_coverage=select.min_coverage, rescue_tokens=select.page_rescue,
                   dense_shortcut=select.dense_shortcut, kernel=config.compile.kernel,
                   offload=config.offload.device_memory_bytes is not None,
                   compiled=config.compile.lower and config.compile.inner in ("auto", "inductor"))

    @property
    def rescue_pages(self) -> int:
        """Whole pages the page rescue adds per layer: ``ceil(rescue_tokens / page_tokens)``
        (0 when either is 0)."""
        return -(-self.rescue_tokens // self.page_tokens) if self.page_tokens else 0

    @property
    def refines(self) -> bool:
        """Whether layers rank candidates beyond their budget (wider candidates or a rescue)."""
        return self.candidate_slots > self.budget or self.rescue_pages > 0

    def for_store(self, page_tokens: int) -> StepSpec:
        """This spec at a store whose page bounds have ``page_tokens`` tokens per page (0: the
        store keeps none, so its layers refine without the page rescue)."""
        return dataclasses.replace(self, page_tokens=page_tokens, rescue_tokens=self.rescue_tokens if page_tokens else 0)

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        return _fx_repr(self)


for _cls in (AttentionVariant, StepSpec):
    register_opaque_type(_cls, typ="value")
