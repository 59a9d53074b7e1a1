"""Kernel specifications: how one attention site specialises the Triton kernels.

A spec is taken from one attention site matched by the backend (SpeContext, arXiv 2512.00722,
section 4: the LLM's attention over the tokens the retrieval head selected) and becomes the
kernels' ``tl.constexpr`` arguments (``launch.split_constexprs``): two equal specs give the
same arguments, hence the same binary in Triton's cache.

Block sizes are resolved in ``__post_init__`` (``0`` means "pick for me", with
``triton.next_power_of_2``), so a spec is always concrete: ``KernelSpec(head_dim=128)`` and
``KernelSpec(head_dim=128, block_n=64)`` are the same key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (``n >= 1``): ``triton.next_power_of_2`` when triton is
    installed (imported lazily, so specs build without it), else the same arithmetic."""
    try:
        from triton import next_power_of_2 as triton_next_power_of_2
    except ImportError:  # pragma: no cover - exercised only where triton is absent
        return 1 << (int(n) - 1).bit_length()
    return int(triton_next_power_of_2(int(n)))


__all__ = [
    "DTYPE_NAMES",
    "KernelSpec",
    "canonical_dtype",
    "next_power_of_2",
    "torch_dtype",
]

#: the kernels' limits (``KernelSpec`` checks them; the compiled step's lowering reads them)
MAX_Q_LEN = 16
MAX_HEAD_DIM = 1024
MAX_GROUP = 256

#: canonical dtype name -> torch dtype
DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "f32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "f16": "fp16",
}
#: smallest tile edge ``tl.dot`` accepts on GPUs
MIN_DOT_BLOCK = 16


def canonical_dtype(dtype: str | torch.dtype) -> str:
    """Return the canonical name (``"fp32"``, ``"bf16"``, ``"fp16"``) of ``dtype``.

    Raises:
        ValueError: for any other dtype (the kernels accumulate in fp32 and support only
            these three storage types).
    """
    if isinstance(dtype, torch.dtype):
        for name, value in DTYPE_NAMES.items():
            if value == dtype:
                return name
        raise ValueError(f"unsupported dtype {dtype}; use one of torch.float32/bfloat16/float16")
    name = _ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPE_NAMES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype of a canonical dtype name."""
    return DTYPE_NAMES[canonical_dtype(name)]


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name}={value!r} must be an int in [{low}, {high}]")


def _check_block(name: str, value: int) -> None:
    if value < MIN_DOT_BLOCK or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= {MIN_DOT_BLOCK}")


def _default_block_n(row_bytes: int) -> int:
    """Selection entries per inner step, from the bytes of one gathered row: keeps one K (or
    V) tile at <= 16 KiB, which compiles for sm_90 without register spills (see
    ``python -m specontext_compile.codegen compile --grid``)."""
    if row_bytes <= 256:
        return 64
    if row_bytes <= 512:
        return 32
    return 16


@dataclass(frozen=True)
class KernelSpec:
    """Specification of one sparse decode attention kernel (flash-decoding, two phases).

    Attributes:
        head_dim: key/query width ``D`` (elements). For MLA, the latent width.
            Non powers of two (80, 96, ...) are padded to ``block_d`` with masks.
        group: query heads per KV head (1 = MHA; GQA groups need not be powers of two).
        dtype: storage dtype of query, keys, values and output: ``"fp32"``, ``"bf16"`` or
            ``"fp16"`` (``torch.dtype`` accepted); scores and sums accumulate in fp32.
        q_len: query tokens per step, 1..16 (decode, speculative verification).
        soft_cap: whether logits are soft-capped, ``cap * tanh(logits / cap)``.
        sliding_window: whether a sliding window also limits each row.
        head_dim_v: value width ``Dv``; ``0`` means ``head_dim``.
        rope_dim: ``> 0`` selects the MLA layout: key = concat(latent, rope), value =
            latent; ``head_dim`` is the latent width and ``rope_dim`` the RoPE width.
        block_n: selection entries gathered per inner step (power of two >= 16; 0 = auto).
        block_m_max: most query rows (group * q_len) packed in one tile; larger groups
            are split over several row tiles (each re-reads the selection).
        num_warps: GPU warps per program (0 = auto); ignored by the interpreter.
        num_stages: software pipelining depth on GPU; ignored by the interpreter.

    Raises:
        ValueError: in ``__post_init__`` for any value out of range.
    """

    head_dim: int = 128
    group: int = 1
    dtype: str = "bf16"
    q_len: int = 1
    soft_cap: bool = False
    sliding_window: bool = False
    head_dim_v: int = 0
    rope_dim: int = 0
    block_n: int = 0
    block_m_max: int = 64
    num_warps: int = 0
    num_stages: int = 2

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)
        set_("dtype", canonical_dtype(self.dtype))
        set_("soft_cap", bool(self.soft_cap))
        set_("sliding_window", bool(self.sliding_window))
        _check_range("head_dim", self.head_dim, 1, MAX_HEAD_DIM)
        _check_range("group", self.group, 1, MAX_GROUP)
        _check_range("q_len", self.q_len, 1, MAX_Q_LEN)
        _check_range("rope_dim", self.rope_dim, 0, 256)
        _check_range("head_dim_v", self.head_dim_v, 0, 1024)
        if self.head_dim_v == 0:
            set_("head_dim_v", self.head_dim)
        if self.rope_dim and self.head_dim_v != self.head_dim:
            raise ValueError(
                f"MLA (rope_dim={self.rope_dim}) uses the latent as value: head_dim_v="
                f"{self.head_dim_v} must equal head_dim={self.head_dim}"
            )
        _check_block("block_m_max", self.block_m_max)
        if self.block_n == 0:
            row_bytes = max(self.block_d, self.block_dv) * self.torch_dtype.itemsize
            set_("block_n", _default_block_n(row_bytes))
        _check_block("block_n", self.block_n)
        if self.num_warps == 0:  # fp32 dots run on FMA units: spread them over more warps
            big = self.block_m * max(self.block_d, self.block_dv) > 32 * 128
            set_("num_warps", 8 if big or self.dtype == "fp32" else 4)
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")
        _check_range("num_stages", self.num_stages, 1, 8)

    # ---- derived tile sizes (all powers of two >= 16, as tl.dot requires on GPU) ----
    @property
    def is_mla(self) -> bool:
        """True for the MLA layout (key = concat(latent, rope), value = latent)."""
        return self.rope_dim > 0

    @property
    def rows(self) -> int:
        """Query rows of one KV group: ``group * q_len``."""
        return self.group * self.q_len

    @property
    def block_m(self) -> int:
        """Rows per tile: ``next_power_of_2(rows)`` clamped to [16, block_m_max]."""
        return min(max(MIN_DOT_BLOCK, next_power_of_2(self.rows)), self.block_m_max)

    @property
    def row_tiles(self) -> int:
        """Row tiles per KV head (1 unless ``rows > block_m_max``)."""
        return -(-self.rows // self.block_m)

    @property
    def block_d(self) -> int:
        """Padded key width."""
        return max(MIN_DOT_BLOCK, next_power_of_2(self.head_dim))

    @property
    def block_dv(self) -> int:
        """Padded value width."""
        return max(MIN_DOT_BLOCK, next_power_of_2(self.head_dim_v))

    @property
    def block_r(self) -> int:
        """Padded RoPE width (MLA only; 16 otherwise, unused)."""
        return max(MIN_DOT_BLOCK, next_power_of_2(max(self.rope_dim, 1)))

    @property
    def torch_dtype(self) -> torch.dtype:
        """Storage dtype as a torch dtype."""
        return DTYPE_NAMES[self.dtype]

    @property
    def name(self) -> str:
        """Short stable identifier, used in generated file names and logs."""
        dims = f"d{self.head_dim}" + (f"r{self.rope_dim}" if self.rope_dim else "")
        if self.head_dim_v != self.head_dim:
            dims += f"v{self.head_dim_v}"
        flags = ("_cap" if self.soft_cap else "") + ("_win" if self.sliding_window else "")
        return (
            f"sparse_decode_{dims}_g{self.group}_q{self.q_len}_{self.dtype}{flags}"
            f"_m{self.block_m}n{self.block_n}"
        )

    def replace(self, **changes) -> KernelSpec:
        """Copy with fields changed (re-validated); see ``_replace_spec``."""
        return _replace_spec(self, ("head_dim_v", "block_n", "num_warps"), changes)


def _replace_spec(spec, derived: tuple[str, ...], changes: dict):
    """``dataclasses.replace`` that re-derives the auto fields (``derived``) that still hold
    their automatic value, so ``spec.replace(head_dim=256)`` also gets the block size of 256;
    a derived field set explicitly (to a non-automatic value) is kept."""
    base = {
        f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in derived
    }
    auto = type(spec)(**base)
    for name in derived:
        if name not in changes and getattr(spec, name) == getattr(auto, name):
            changes[name] = 0
    return dataclasses.replace(spec, **changes)
