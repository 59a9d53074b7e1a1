"""vLLM's CPU attention backend with speculative sparse decoding (issue 54).

The backend keeps vLLM's scheduler, paged KV cache and prefill kernel, and changes what the
decode rows read (SpeContext section 4, as our ``torch.compile`` backend does it):

1. **Once per step, before the first layer's attention**, every decode row gets one selection
   per KV head: the lagged-query scorer (:func:`specontext_compile.runtime.scorers.lagged_query_score`:
   the previous token's queries of the retrieval layers against those layers' keys) ranks the
   row's past tokens, and :func:`~specontext_compile.runtime.aten_step.select_positions` keeps
   ``budget`` tokens in whole blocks: attention sinks, the recent window and the top-scored
   blocks (:mod:`.selection`). A row
   whose previous query is not recorded (its first decode step after a prefill run
   elsewhere, a preemption) ranks by recency and is counted.
2. **Every layer** attends each decode row to its selected blocks only, with vLLM's own
   kernel over a block table of those blocks, one call for every KV head (the selection is
   per KV head; :mod:`.selection` says why whole blocks); a layer that refines (``page_rescue``,
   ``candidates > 1``) keeps the ``budget`` best tokens of its candidates and attends to them
   with the plugin's kernel (:mod:`.refine`).
3. **Prefill and chunked-prefill rows** run vLLM's own kernel, on their slice of the batch
   (the builder sets ``reorder_batch_threshold = 1``: vLLM puts decode rows first).
4. **Retrieval layers record** each request's last query row in a per-block slot
   (:class:`~.state.LaggedQueries`), keyed by the physical KV row of its token: preemption and
   recomputation rewrite it, a shared prefix block keeps the prefix's own query.

The step counts itself in ``torch._dynamo.utils.counters["specontext_vllm"]`` (per engine
process): ``selection_steps``, ``int8_selection_steps`` (those that scored the retrieval
layers' int8 keys, option ``selection_keys="int8"``), ``recency_rows`` (decode rows ranked by recency),
``sparse_decode_rows`` (decode rows x layers served from a selection) and
``dense_prefill_tokens`` (tokens x layers on vLLM's kernel).

Options come through vLLM's configuration, ``additional_config={"specontext": {...}}``, with
the backend's names and validation (:class:`~specontext_compile.config.SpeContextConfig`);
without that key this backend is vLLM's CPU attention unchanged. With ``page_rescue`` (tokens)
each layer it covers adds its own rescued blocks to the shared selection (:mod:`.rescue`;
counter ``rescue_rows``) and refines them; with ``candidates > 1`` the shared selection keeps
``candidates x budget`` tokens and every layer refines: a refining layer keeps the ``budget``
best of its candidate tokens by its own query's exact logits and attends to those only
(:mod:`.refine`, as the backend's step; counter ``refined_rows``). Sliding-window, ALiBi,
soft-capped and sink-logit layers and FP8 caches stay on vLLM's kernel (logged once per layer).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import torch
from specontext_compile.runtime.torch_private import counters
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from .int8_keys import Int8Keys
from .layout import probe_layout
from .options import plugin_options
from .refine import forced_counts, refine_attend
from .rescue import PageBounds, rescue_blocks
from .selection import BlockSelection, every_block, select_blocks, with_blocks, with_dense_rows
from .state import LaggedQueries

logger = logging.getLogger(__name__)

__all__ = ["SpeContextCPUBackend", "SpeContextImpl", "SpeContextMetadata", "SpeContextMetadataBuilder"]

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """The decoder layer index in a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7).

    Raises:
        ValueError: for a name without one."""
    found = _LAYER_INDEX.findall(layer_name)
    if not found:
        raise ValueError(f"specontext: no layer index in vLLM layer name {layer_name!r}")
    return int(found[0])


@dataclasses.dataclass
class SpeContextMetadata(CPUAttentionMetadata):
    """vLLM's CPU metadata plus the step's split and selection.

    Attributes:
        num_decodes: decode rows, first in the batch (one query token each).
        prefill: vLLM's metadata for the other rows alone (None when there are none).
        retrieval: the retrieval layers' names, in order.
        selection: the decode rows' selected blocks per KV head, set by the forward of the
            step's first layer the plugin serves (:class:`~.selection.BlockSelection`).
        plan: the decode rows' call of vLLM's kernel made with the selection
            (:class:`KernelPlan`), built by the step's first layer that does not refine.
        dense_rows: bool ``[num_decodes]``, the rows that attend densely on every layer
            (option ``dense_below``), or None; ``dense_count``: how many (read once per step).
        dense_plan: the dense rows' call of vLLM's kernel over every block, built by the step's
            first refining layer (a refinement keeps ``budget`` tokens).
    """

    num_decodes: int = 0
    prefill: CPUAttentionMetadata | None = None
    retrieval: tuple[str, ...] = ()
    selection: BlockSelection | None = None
    plan: KernelPlan | None = None
    dense_rows: torch.Tensor | None = None
    dense_count: int = 0
    dense_plan: KernelPlan | None = None


@dataclasses.dataclass
class KernelPlan:
    """One call of vLLM's kernel for every decode row and KV head of a layer: each (row, KV
    head) pair is a request of its own, whose query heads are the KV head's group, over the
    cache viewed as ``[blocks * num_kv_heads, 1, ...]`` (physical block ``p`` of KV head ``h``
    is view block ``p * num_kv_heads + h``), so the selections of different KV heads need
    no call each.

    Attributes:
        tables: int32 ``[rows * num_kv_heads, blocks]`` view blocks per request.
        seq_lens: int32 ``[rows * num_kv_heads]`` tokens each request reads.
        starts: int32 ``[rows * num_kv_heads + 1]`` query start per request (one token each).
        schedule: vLLM's kernel schedule for them.
    """

    tables: torch.Tensor
    seq_lens: torch.Tensor
    starts: torch.Tensor
    schedule: Any


class SpeContextMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU builder; with options set, it also splits decode rows from the rest."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.options = plugin_options(vllm_config)
        if self.options is not None:
            self._init_reorder_batch_threshold(1)
            ordered = sorted(layer_names, key=layer_index)
            picks = self.options.retrieval_layers_for(len(ordered))
            self.retrieval = tuple(ordered[i] for i in picks)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.options is None or self.is_cross_attention or self.is_encoder_only_attention:
            return base
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(common_attn_metadata, 1)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(CPUAttentionMetadata)}
        meta = SpeContextMetadata(**fields, num_decodes=num_decodes, retrieval=self.retrieval)
        meta.num_decode_tokens = num_decode_tokens
        dense = self.options.dense_rows(base.seq_lens[:num_decodes]) if num_decodes else None
        if dense is not None:
            meta.dense_count = int(dense.sum())  # the step's host read of it
            meta.dense_rows = dense if meta.dense_count else None
        if num_prefills:
            meta.prefill = self._prefill_metadata(base, num_decodes, num_decode_tokens)
        return meta

    def _prefill_metadata(self, base: CPUAttentionMetadata, num_decodes: int, num_decode_tokens: int
                          ) -> CPUAttentionMetadata:
        """vLLM's metadata for the rows after the decode rows, as if they were the batch."""
        start = base.query_start_loc[num_decodes:] - num_decode_tokens
        seq_lens = base.seq_lens[num_decodes:]
        scheduler = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.shape[0], num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=seq_lens, dtype=self.dtype, query_start_loc=start,
            causal=base.causal, sliding_window_size=self.window_size, isa=self.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None, kv_cache_dtype=self.kv_cache_dtype)
        return CPUAttentionMetadata(
            num_actual_tokens=base.num_actual_tokens - num_decode_tokens, max_query_len=base.max_query_len,
            query_start_loc=start, max_seq_len=base.max_seq_len, seq_lens=seq_lens,
            block_table=base.block_table[num_decodes:], slot_mapping=base.slot_mapping[num_decode_tokens:],
            scheduler_metadata=scheduler, causal=base.causal)


class SpeContextImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, with decode rows attending to the step's selection."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.options = plugin_options(get_current_vllm_config())
        self.reason = self._dense_reason()
        if self.options is not None and self.reason is not None:
            logger.warning("specontext: a layer stays on vLLM's dense kernel: %s", self.reason)
        self.record: LaggedQueries | None = None
        self.int8_keys: Int8Keys | None = None  # a retrieval layer's int8 keys (option selection_keys="int8")
        self.bounds: PageBounds | None = None  # this layer's page bounds, with option page_rescue
        self.num_layers = get_current_vllm_config().model_config.hf_text_config.num_hidden_layers
        self.rescuing: bool | None = None  # whether this layer adds rescued blocks (known at its first call)
        self.refining: bool | None = None  # whether it refines its candidates to budget tokens (:mod:`.refine`)
        self.dense_layer: bool | None = None  # whether its decode rows stay on vLLM's kernel (dense_layers)

    def _rescues(self, layer) -> bool:
        if self.rescuing is None:
            self.rescuing = (self.options is not None and self.reason is None
                             and self.options.rescues(layer_index(layer.layer_name), self.num_layers))
        return self.rescuing

    def _refines(self, layer) -> bool:
        if self.refining is None:
            self.refining = (self.options is not None and self.reason is None
                             and self.options.refines(layer_index(layer.layer_name), self.num_layers))
        return self.refining

    def _dense(self, layer) -> bool:
        if self.dense_layer is None:
            self.dense_layer = self.options is not None and self.options.dense(layer_index(layer.layer_name),
                                                                                self.num_layers)
        return self.dense_layer

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        """vLLM's cache write; a layer with the page rescue also folds the keys into its blocks'
        bounds (:class:`~.rescue.PageBounds`)."""
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if self._rescues(layer) and kv_cache.numel():
            if self.bounds is None or self.bounds.low.shape[0] != kv_cache.shape[0]:  # (re)allocated cache
                self.bounds = PageBounds.for_cache(kv_cache, self.head_size)
            self.bounds.write(key, slot_mapping)

    def _dense_reason(self) -> str | None:
        if self.alibi_slopes is not None:
            return "ALiBi"
        if self.sliding_window != -1:
            return "sliding-window attention"
        if self.logits_soft_cap:
            return "soft-capped logits"
        if self.sinks is not None:
            return "learned sink logits"
        if self.is_fp8_kv_cache:
            return "an FP8 KV cache (serve with kv_cache_dtype='auto')"
        return None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if not isinstance(attn_metadata, SpeContextMetadata) or self.reason is not None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        meta, name = attn_metadata, layer.layer_name
        layout = probe_layout(layer.isa, kv_cache.dtype, kv_cache.shape[2], self.head_size)
        stats = counters["specontext_vllm"]
        if (meta.num_decodes and meta.selection is None  # the step's first layer: before any layer records
                and not self.options.every_layer_dense(self.num_layers)):
            meta.selection = self._select(meta, layout)
            stats["selection_steps"] += 1
            stats["recency_rows"] += int(meta.selection.recency_rows)  # once per step, not per layer
        if self._dense(layer):  # option dense_layers: vLLM's kernel over every row, as without the plugin
            super().forward(layer, query, key, value, kv_cache, meta, output)
            stats["dense_decode_rows"] += meta.num_decode_tokens
            stats["dense_prefill_tokens"] += meta.num_actual_tokens - meta.num_decode_tokens
        else:
            self._sparse_forward(layer, query, key, value, kv_cache, meta, layout, output)
        if name in meta.retrieval:
            self._record(query, kv_cache, meta)
            if self.options.int8_selection:
                self._keep_int8_keys(key, kv_cache, meta)
        return output

    def _sparse_forward(self, layer, query, key, value, kv_cache, meta: SpeContextMetadata, layout, output) -> None:
        """Prefill rows on vLLM's kernel over their own metadata; decode rows over the step's
        selection (refined on a refining layer); rows of option ``dense_below`` over every block."""
        stats = counters["specontext_vllm"]
        if meta.prefill is not None:
            start = meta.num_decode_tokens
            stats["dense_prefill_tokens"] += meta.prefill.num_actual_tokens
            super().forward(layer, query[start:], key[start:], value[start:], kv_cache, meta.prefill,
                            output[start:meta.num_actual_tokens])
        if not meta.num_decodes:
            return
        rows = meta.num_decode_tokens
        stats["sparse_decode_rows"] += rows - meta.dense_count
        stats["dense_decode_rows"] += meta.dense_count
        if self._refines(layer) and meta.dense_count < rows:
            guarded = self._refine(layer, query[:rows], kv_cache, meta, layout, output[:rows])
            if meta.dense_rows is not None:  # the refinement keeps budget tokens: these rows attend to all
                if meta.dense_plan is None:  # once per step
                    meta.dense_plan = self._every_block_plan(meta.dense_rows, meta, layout, query.dtype, layer.isa)
                self._attend_rows(meta.dense_rows, query, kv_cache, meta.dense_plan, output)
            if guarded is not None:  # option min_coverage: rows whose kept tokens held too little
                self._attend_rows(guarded, query, kv_cache,
                                  self._every_block_plan(guarded, meta, layout, query.dtype, layer.isa), output)
        else:  # the selection holds every block of a dense row (option dense_below)
            if meta.plan is None:  # once per step, for the layers that do not refine
                meta.plan = self._plan(meta.selection, query.dtype, layer.isa)
            self._decode(query[:rows], kv_cache, meta.plan, output[:rows])

    def _every_block_plan(self, rows: torch.Tensor, meta: SpeContextMetadata, layout, dtype: torch.dtype,
                          isa: str) -> KernelPlan:
        """The :class:`KernelPlan` of the decode rows ``rows`` (bool ``[num_decodes]``) over
        every block of their requests: their exact attention through vLLM's kernel."""
        index = rows.nonzero().squeeze(1)
        lens = meta.seq_lens[index]
        blocks = -(-int(lens.max()) // layout.block_size)
        return self._plan(every_block(meta.block_table[index], lens, layout.block_size, blocks, self.num_kv_heads),
                          dtype, isa)

    def _attend_rows(self, rows: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, plan: KernelPlan,
                     output: torch.Tensor) -> None:
        """The decode rows ``rows`` (bool ``[num_decodes]``) attend with ``plan``
        (:meth:`_every_block_plan`), written over their outputs."""
        index = rows.nonzero().squeeze(1)
        out = torch.empty((index.shape[0],) + tuple(output.shape[1:]), dtype=output.dtype)
        self._decode(query[index], kv_cache, plan, out)
        output[index] = out

    def _record(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: SpeContextMetadata) -> None:
        """Keep each request's last query row for the next step's selection."""
        if self.record is None:
            self.record = LaggedQueries.for_cache(kv_cache, self.num_heads, self.head_size)
        last = meta.query_start_loc[1:] - 1
        self.record.write(query[last], meta.slot_mapping[last])

    def _keep_int8_keys(self, key: torch.Tensor, kv_cache: torch.Tensor, meta: SpeContextMetadata) -> None:
        """Write the int8 rows of every key this step wrote (option ``selection_keys="int8"``,
        :mod:`.int8_keys`; the same slots as vLLM's cache write)."""
        if key is None or not kv_cache.numel():
            return
        if self.int8_keys is None or not self.int8_keys.fits(kv_cache):  # (re)allocated cache
            self.int8_keys = Int8Keys.for_cache(kv_cache, self.head_size)
        n = meta.num_actual_tokens
        self.int8_keys.write(key[:n], meta.slot_mapping[:n])

    def _select(self, meta: SpeContextMetadata, layout) -> BlockSelection:
        table, lens = meta.block_table[:meta.num_decodes], meta.seq_lens[:meta.num_decodes]
        if meta.dense_count == meta.num_decodes:  # option dense_below: every row dense, no scores
            return with_dense_rows(None, meta.dense_rows, table, lens, layout.block_size, self.num_kv_heads)
        layers = get_forward_context().no_compile_layers
        retrieval = [layers[n] for n in meta.retrieval]
        # None on the first step ever (nothing recorded yet): every row ranks by recency
        records = None if any(r.impl.record is None for r in retrieval) else [r.impl.record for r in retrieval]
        copies = [r.impl.int8_keys for r in retrieval] if self.options.int8_selection else None
        if copies is not None and any(c is None for c in copies):
            copies = None  # a retrieval layer without its keys in forward (KV sharing): vLLM's cache
        if records is not None and copies is not None:
            counters["specontext_vllm"]["int8_selection_steps"] += 1
        selection = select_blocks(records, [r.kv_cache for r in retrieval], table, lens, layout, self.options,
                                  self.scale, copies)
        if meta.dense_rows is not None:
            selection = with_dense_rows(selection, meta.dense_rows, table, lens, layout.block_size,
                                        self.num_kv_heads)
        return selection

    def _refine(self, layer, query: torch.Tensor, kv_cache: torch.Tensor, meta: SpeContextMetadata, layout,
                output: torch.Tensor) -> torch.Tensor | None:
        """The decode rows' refined attention (:mod:`.refine`): candidates from the shared
        selection and, on a rescuing layer, its rescued blocks; ``budget`` tokens kept. Returns
        the rows the fidelity guard sends dense (option ``min_coverage``: a row whose kept
        tokens hold less than that share of its candidates' softmax mass at any KV head; bool
        ``[rows]``, one host read per layer), or None (none, or the guard off)."""
        rows, selection, stats = query.shape[0], meta.selection, counters["specontext_vllm"]
        if self.bounds is not None and self._rescues(layer):
            selection = self._rescue(query, meta)
            stats["rescue_rows"] += rows - meta.dense_count
        sinks, recent = forced_counts(self.options.budget, self.options.sink_tokens, self.options.recent_window)
        guard = self.options.min_coverage > 0
        result = refine_attend(layout, kv_cache, meta.block_table[:rows], selection, query, self.scale,
                               meta.seq_lens[:rows], self.options.budget, sinks, recent, coverage=guard)
        out, share = result if guard else (result, None)
        output.copy_(out.view_as(output))
        stats["refined_rows"] += rows - meta.dense_count  # the dense rows' outputs are replaced
        if share is None:
            return None
        guarded = (share < self.options.min_coverage).any(-1)
        if meta.dense_rows is not None:
            guarded &= ~meta.dense_rows  # attend to every block anyway
        count = int(guarded.sum())
        stats["guard_dense_rows"] += count
        return guarded if count else None

    def _rescue(self, query: torch.Tensor, meta: SpeContextMetadata) -> BlockSelection:
        """The step's selection plus this layer's rescued blocks (:mod:`.rescue`)."""
        rows, shared = query.shape[0], meta.selection
        table, lens = meta.block_table[:rows], meta.seq_lens[:rows]
        added = rescue_blocks(self.bounds, table, lens, query, shared.logical,
                              self.options.page_rescue // self.bounds.block_size, shared.blocks)
        return with_blocks(torch.cat([shared.logical, added], dim=-1), table, lens, self.bounds.block_size,
                           shared.recency_rows, shared.blocks)

    def _plan(self, selection: BlockSelection, dtype: torch.dtype, isa: str) -> KernelPlan:
        """The :class:`KernelPlan` of ``selection`` (once per step, or per rescuing layer)."""
        rows, num_kv, width = selection.tables.shape
        head = torch.arange(num_kv, dtype=torch.int32).view(1, num_kv, 1)
        tables = (selection.tables * num_kv + head).view(rows * num_kv, width)
        lens = selection.seq_lens.reshape(rows * num_kv)
        starts = torch.arange(rows * num_kv + 1, dtype=torch.int32)
        schedule = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=rows * num_kv, num_heads=self.num_queries_per_kv, num_kv_heads=1, head_dim=self.head_size,
            seq_lens=lens, dtype=dtype, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None, kv_cache_dtype=self.kv_cache_dtype)
        return KernelPlan(tables, lens, starts, schedule)

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: KernelPlan, output: torch.Tensor) -> None:
        """The decode rows (``query`` ``[rows, num_heads, head_dim]``, heads grouped by KV
        head) attend with vLLM's kernel, in one call, each KV head over its own selected
        blocks (``plan``); written into ``output`` (the rows' slice of vLLM's output)."""
        blocks, num_kv, block_size, _ = kv_cache.shape
        # [blocks * kv, 1, 2 * block_size, head_dim]: view block p * kv + h is KV head h of block p
        key_cache, value_cache = kv_cache.view(blocks * num_kv, 1, 2 * block_size, -1).chunk(2, dim=2)
        rows, group = query.shape[0], self.num_queries_per_kv
        q = query.reshape(rows * num_kv, group, self.head_size)
        out = output.view(rows * num_kv, group, self.head_size)
        if not (q.is_contiguous() and out.is_contiguous()):
            q, o = q.contiguous(), torch.empty((rows * num_kv, group, self.head_size), dtype=query.dtype)
        else:
            o = out
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=o, query_start_loc=plan.starts,
            seq_lens=plan.seq_lens, scale=self.scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=plan.tables, softcap=0.0, scheduler_metadata=plan.schedule, s_aux=None,
            kv_cache_dtype=self.kv_cache_dtype)
        if o is not out:
            out.copy_(o)


class SpeContextCPUBackend(CPUAttentionBackend):
    """vLLM's ``CPU_ATTN`` entry, overridden by :func:`specontext_vllm.register`."""

    @staticmethod
    def get_impl_cls():
        return SpeContextImpl

    @staticmethod
    def get_builder_cls():
        return SpeContextMetadataBuilder
