"""Every private torch API the package uses, in one place: what it serves, why no public API
does, and the torch version it was checked against (:data:`CHECKED_AGAINST`). Other modules
import these names from here and touch no ``torch._*`` themselves (issue 53, item 2; checked
by ``tests/test_layers.py``); the one exception is ``specontext_compile/logs.py``, the module
about torch's logging registry (``torch._logging``: how a package registers a ``TORCH_LOGS``
name and artifacts). ``specontext_compile/fallbacks.py`` filters dynamo's graph-break logger
by its name, a string.

Heavy modules (inductor) are imported on first use, not when this module is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.utils import counters  # noqa: F401  (re-exported)
from torch._ops import OpOverload, OpOverloadPacket  # noqa: F401  (re-exported)

__all__ = ["CHECKED_AGAINST", "C_LINEAR", "C_SDPA", "OpOverload", "OpOverloadPacket", "compile_fx", "compile_id",
           "counters", "cpu_has_amx", "custom_graph_pass", "effect_of", "force_stride_order", "inductor_config",
           "mark_static_address", "mode_options", "opaque_base", "ordered_effect", "recompile_limit",
           "placeholder_symbol", "register_opaque_type", "set_recompile_limit"]

#: the torch release every wrapper here was checked against (the version CI installs)
CHECKED_AGAINST = "2.13.0"

# counters: dynamo's counter dictionary, where torch's own compile statistics are and where
# our path counters (``counters["specontext"]``) sit beside them; torch has no public counter API.
# OpOverload, OpOverloadPacket: the types of an op target in an FX graph (a call recorded by
# dynamo is a packet, one made by AOTAutograd an overload); torch.library takes them but names
# no public alias.

#: what dynamo records for ``F.linear`` and ``F.scaled_dot_product_attention``: the C
#: functions (the pass matches both spellings; no public name for the C ones)
C_LINEAR = torch._C._nn.linear
C_SDPA = torch._C._nn.scaled_dot_product_attention


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Sapphire Rapids and later): torch asks cpuinfo
    (``torch.cpu._is_amx_tile_supported``); no public API says it. False if the probe is gone."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if callable(probe) else False


def force_stride_order(t: torch.Tensor, stride) -> torch.Tensor:
    """Inductor's prim that makes ``t`` a buffer of its own in the compiled code (a realized
    input of a fused reduction, :func:`.sparse_attention._realized`); traced only while
    inductor compiles. No public equivalent: ``torch.compiler`` has no realization hint."""
    from torch._inductor import inductor_prims

    return inductor_prims.force_stride_order(t, stride)


def placeholder_symbol(value: torch.SymInt):
    """The symbol inductor binds for a ``SymInt`` graph input: the input's own expression
    *before* the shape environment's replacements (``SymNode._expr``; inductor's
    ``_get_placeholder_expr``), which ``str(value)`` and ``value.node.expr`` hide once dynamo
    found it equal to another symbol. No public API tells the two apart."""
    return value.node._expr


def mark_static_address(t: torch.Tensor) -> None:
    """Tell dynamo a state tensor keeps its address across calls (no guard on it; CUDA
    graphs may capture it): ``torch._dynamo.mark_static_address`` has no public alias in
    ``torch.compiler``."""
    torch._dynamo.mark_static_address(t, guard=False)


def opaque_base() -> type:
    """The base class torch 2.11 asked of every opaque custom-op argument type (later ones
    accept plain classes): ``torch._opaque_base.OpaqueBase``, or ``object`` where torch has
    none."""
    try:
        from torch._opaque_base import OpaqueBase
    except ImportError:  # torch without the base class
        return object
    return OpaqueBase


def register_opaque_type(cls: type, **kwargs: Any) -> None:
    """Register ``cls`` as an opaque custom-op argument (a value type such as the step's spec,
    or a reference type such as the KV-offload manager): ``torch._library.opaque_object``,
    the only way to pass a Python object through a custom op's schema.

    Raises:
        ImportError: a torch without opaque custom-op arguments (the message names the fix).
    """
    try:
        from torch._library.opaque_object import register_opaque_type as register
    except ImportError as err:  # pragma: no cover - older torch
        raise ImportError(f"specontext needs a torch with opaque custom-op arguments (torch "
                          f"{CHECKED_AGAINST} is tested): upgrade torch") from err
    register(cls, **kwargs)


def ordered_effect(op: OpOverload) -> None:
    """Declare an ordered effect on ``op`` (compilers thread effect tokens through it, never
    reorder or drop it): torch does not infer effects for opaque reference arguments, and
    ``torch.library._register_effectful_op`` is the only way to declare one."""
    from torch._library.effects import EffectType

    torch.library._register_effectful_op(op, EffectType.ORDERED)


def effect_of(op: OpOverload):
    """The effect declared on ``op`` (None when none): ``torch._higher_order_ops.effects``."""
    from torch._higher_order_ops.effects import _get_effect

    return _get_effect(op)


def custom_graph_pass():
    """``(CustomGraphPass, get_hash_for_files)``: inductor's base class for a post-grad pass
    whose ``uuid`` keys inductor's caches, and its helper hashing source files
    (``torch._inductor.custom_graph_pass``; the public ``torch.compile(options=...)`` takes
    such a pass but the class lives there)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    return CustomGraphPass, get_hash_for_files


def compile_fx(gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any):
    """Inductor's entry point for a backend that hands its graph on
    (``torch._inductor.compile_fx.compile_fx``: what ``backend="inductor"`` calls; a custom
    backend has no public way to chain to inductor with options)."""
    from torch._inductor.compile_fx import compile_fx as inductor_compile_fx

    return inductor_compile_fx(gm, example_inputs, **kwargs)


def inductor_config():
    """Inductor's config module (``torch._inductor.config``: the options ``torch.compile``
    takes as ``options=``; read for what the caller set, patched per graph)."""
    from torch._inductor import config

    return config


def mode_options(mode: str) -> dict[str, Any]:
    """The inductor options of a ``torch.compile`` mode (``torch._inductor.list_mode_options``)."""
    from torch._inductor import list_mode_options

    return list_mode_options(mode)


def recompile_limit() -> int:
    """Dynamo's per-frame recompile limit (``torch._dynamo.config.recompile_limit``)."""
    return torch._dynamo.config.recompile_limit


def set_recompile_limit(limit: int) -> None:
    """Raise dynamo's recompile limit (thread-local config) for a frame that compiles once per
    padded query size (continuous batching)."""
    torch._dynamo.config.recompile_limit = limit


def compile_id():
    """The id of the compile in progress (``torch._guards.CompileContext``), or None: which
    frame a graph break belongs to."""
    from torch._guards import CompileContext

    return CompileContext.current_compile_id()
