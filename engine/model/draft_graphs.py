"""CUDA graphs of a draft's tree forward: one launch for the ~1,000 kernels of a growth round's draft pass.

A small draft's forward is bound by launching its kernels, not by running them (docs/bench/gpu.md: 12-25 ms a
forward on an H200 whose device work is a few milliseconds). A graph replays them in one launch, but it fixes
shapes and addresses, so a graphed forward is a static form of the pass (StaticPass), over caches that share
one KVBlock (the KV pool's draft caches: DecoderRunner.new_caches), whichever of them a round's segments use:
- each segment's rows padded to a bucket (ROW_BUCKETS), every segment of the group to the same one;
- at each layer one indexed write puts every row's keys and values at its cache's slots (block row
  cache index * capacity + slot; a padded row writes the slot after its segment's last, free: a growth's next
  forward writes from its next slot on), and one indexed read gathers slots [0, kv_len) of each segment's
  cache, kv_len a power of two (KV_MIN at least, the capacity at most) past start_slot + bucket;
- one attention call for the whole group under a block-diagonal additive mask: a segment's rows see their
  own cache's gathered slots as their `allowed` says, nothing else; padded rows see their cache's slot 0
  (finite rows: a masked slot's value must never be NaN, or 0 x NaN poisons a row that masks it);
- ids, positions, rotary cos/sin, indices and the mask are copied into the pass's buffers before a replay;
  the final norm and the head run after it over the rows asked for, eagerly (no logits buffer per graph).
Outputs equal the eager pass's up to the kernels' rounding at other shapes, so only a draft runs this way:
verification checks whatever it proposes, and the output stays the target's (tests/model/test_draft_graphs.py).

DraftGraphs keeps one graph per (block, segments, bucket, kv_len), captured at its first use on a stream of its
own (no device-wide sync: a target pass may be running beside it), all in one memory pool; a pass it cannot
take (prefill chunks, no `allowed`, rows past the last bucket, no room, caches of different blocks, a span
past MAX_SPAN, masks past MASK_BYTES) runs eagerly. On a CPU the same static pass runs without capture (`capture=False`: what the CPU tests check).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from engine.model.hf_attention import GroupInputs, engine_attention
from engine.model.kv_cache import KVBlock
from engine.model.runner import DecoderRunner, ResidentLayers, Segment
from engine.offload.device import main_thread_stream

log = logging.getLogger(__name__)

ROW_BUCKETS = (8, 16, 32, 64, 128)  # rows a segment is padded to; a forward of more rows runs eagerly
KV_MIN = 1024  # the smallest attended span (slots); spans double from here up to the cache's capacity
MAX_GRAPHS = 128  # graphs kept; a pass of a new shape past this runs eagerly
MAX_SPAN = 16384  # slots a segment attends at most (a longer context's forwards run eagerly)
# every pass's mask buffer together (segments^2 x bucket x span additive values in the block layout: 4
# segments of 128 rows over 4,096 slots take 17 MB; segments x ... in the segments layout); past it: eagerly
MASK_BYTES = 256 << 20
LAYOUTS = ("block", "segments")  # attention_layout


def row_bucket(rows: int) -> int | None:
    """The smallest bucket holding `rows`, or None past the largest."""
    return next((bucket for bucket in ROW_BUCKETS if rows <= bucket), None)


def kv_span(end: int, capacity: int) -> int | None:
    """Slots [0, span) a segment writing up to slot `end` (exclusive) attends: a power of two >= end, at least
    KV_MIN, at most `capacity`; None when `end` exceeds the capacity."""
    if end > capacity:
        return None
    return min(capacity, max(KV_MIN, 1 << (end - 1).bit_length()))


def attention_layout() -> str:
    """How a graphed pass attends: "block" (one call under a block-diagonal mask: measured on the H200) or
    "segments" (a call per segment over its own span: segments x fewer mask values and attention work, more
    kernels; SPECEXEC_DRAFT_GRAPH_ATTENTION=segments, for bench.gpu_check's draftpass to compare)."""
    layout = os.environ.get("SPECEXEC_DRAFT_GRAPH_ATTENTION", "block")
    if layout not in LAYOUTS:
        raise ValueError(f"SPECEXEC_DRAFT_GRAPH_ATTENTION must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    return layout


PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def graphable(runner: DecoderRunner) -> bool:
    """Whether the runner's pass has a static form here: resident layers, full attention in every layer
    (no sliding windows, no linear-attention layers), dense MLPs, and plain weights: a quantized layer (int4 nibbles,
    FP8, MXFP4: a quantized self-draft) makes its full-size matrices per call, which a graph's pool would hold
    for good beside the memory plan."""
    if not (isinstance(runner.layers, ResidentLayers) and runner.window_set == {None} and not any(runner.linear_layers)):
        return False
    if any(hasattr(getattr(layer, "mlp", None), "experts") or hasattr(layer, "block_sparse_moe")
           for layer in runner.hf_layers):
        return False  # mixture of experts: routing picks rows by data (host syncs a capture cannot hold)
    tensors = (t for layer in runner.hf_layers for t in (*layer.parameters(), *layer.buffers()))
    return all(t.dtype in PLAIN_DTYPES or t.dtype == torch.int64 for t in tensors)  # int64: index buffers


class Gathered:
    """keys (or values) of a StaticPass's segments as attend_layer indexes them: [layer] -> [kv_heads, 1,
    segments * kv_len, head_dim], each segment's slots [0, kv_len) in turn (one index_select)."""

    def __init__(self, tensor: torch.Tensor, read_index: torch.Tensor):
        self.tensor, self.read_index = tensor, read_index

    def __getitem__(self, layer: int) -> torch.Tensor:
        return KVBlock.flat(self.tensor, layer).index_select(1, self.read_index).unsqueeze(1)


class PooledRows:
    """Rows of a StaticPass as attend_layer's segment: writes at `write_index`, reads the slots `read_index`
    gathers, under `mask`. Layout "block": every segment's rows as one (`alone`: the whole block, one attention
    call under a block-diagonal mask); "segments": one each (its `rows` of the block, its own span and mask)."""

    def __init__(self, block: KVBlock, write_index: torch.Tensor, read_index: torch.Tensor, mask: torch.Tensor,
                 layer_rows: range | dict[int, int], rows: slice | None = None):
        self.block, self.write_index = block, write_index
        self.keys, self.values = Gathered(block.keys, read_index), Gathered(block.values, read_index)
        self.masks = {None: mask}
        self.layer_rows = layer_rows
        self.alone, self.rows = rows is None, rows or slice(None)

    def write(self, row: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """key, value [1, kv_heads, rows, head_dim] at each row's block slot (write_index [rows])."""
        KVBlock.flat(self.block.keys, row).index_copy_(1, self.write_index, key[0])
        KVBlock.flat(self.block.values, row).index_copy_(1, self.write_index, value[0])


@dataclass(frozen=True)
class StaticShape:
    block: int  # id() of the caches' KVBlock
    segments: int
    bucket: int  # rows of every segment
    kv_len: int  # slots each segment attends


class StaticPass:
    """A draft pass of one StaticShape: input buffers, the pass over them, its graph."""

    def __init__(self, runner: DecoderRunner, block: KVBlock, layer_rows: range | dict[int, int], segments: int,
                 bucket: int, kv_len: int, layout: str = "block"):
        device, total = runner.device, bucket * segments
        self.runner, self.block, self.bucket, self.kv_len = runner, block, bucket, kv_len
        self.ids = torch.zeros(total, dtype=torch.long, device=device)  # [total]
        self.positions = torch.zeros(1, total, dtype=torch.long, device=device)  # [1, total]
        rotary = runner._rotary_inputs(self.positions[0], kv_len)
        self.rotary = {key: (cos.clone(), sin.clone()) for key, (cos, sin) in rotary.items()}  # [1, total, dim] each
        self.write_index = torch.zeros(total, dtype=torch.long, device=device)  # [total] block slot of each row
        self.read_index = torch.zeros(segments * kv_len, dtype=torch.long, device=device)  # [segments * kv_len]
        if layout == "block":  # [1, 1, total, segments * kv_len]; segment i's [bucket, kv_len] on the diagonal
            self.mask = torch.zeros(1, 1, total, segments * kv_len, dtype=runner.dtype, device=device)
            self.views = [self.mask[0, 0, i * bucket : (i + 1) * bucket, i * kv_len : (i + 1) * kv_len]
                          for i in range(segments)]
            parts = [PooledRows(block, self.write_index, self.read_index, self.mask, layer_rows)]
        else:  # "segments": [segments, bucket, kv_len]
            self.mask = torch.zeros(segments, bucket, kv_len, dtype=runner.dtype, device=device)
            self.views = list(self.mask)
            parts = [PooledRows(block, self.write_index[i * bucket : (i + 1) * bucket],
                                self.read_index[i * kv_len : (i + 1) * kv_len], self.mask[i][None, None], layer_rows,
                                slice(i * bucket, (i + 1) * bucket)) for i in range(segments)]
        self.group = GroupInputs(self.positions, self.rotary, parts, runner.dtype)  # type: ignore[arg-type]
        self.offsets = torch.arange(max(bucket, kv_len), device=device)
        self.fill = torch.finfo(runner.dtype).min
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None  # [1, total, hidden]: the captured pass's output

    def load(self, group: list[Segment]) -> None:
        """The group's ids, positions, indices and masks into the buffers (segment i's rows from i * bucket)."""
        bucket, kv_len, capacity = self.bucket, self.kv_len, self.block.capacity
        self.ids.zero_()
        self.positions.zero_()
        self.mask.fill_(self.fill)
        for i, (s, mask) in enumerate(zip(group, self.views, strict=True)):
            row, col, num = i * bucket, i * kv_len, s.input_ids.shape[0]
            base = s.cache.block_index * capacity
            self.ids[row : row + num].copy_(s.input_ids)
            self.positions[0, row : row + num].copy_(s.position_ids)
            torch.add(self.offsets[:bucket], base + s.start_slot, out=self.write_index[row : row + bucket])
            torch.add(self.offsets[:kv_len], base, out=self.read_index[col : col + kv_len])
            mask[:num, : s.start_slot + num].masked_fill_(s.allowed, 0.0)  # [bucket, kv_len]: this segment's
            if num < bucket:
                mask[num:, 0] = 0.0  # padded rows: their cache's slot 0
            s.cache.write_positions(s.start_slot, s.position_ids)
        for key, (cos, sin) in self.runner._rotary_inputs(self.positions[0], kv_len).items():
            self.rotary[key][0].copy_(cos)
            self.rotary[key][1].copy_(sin)

    def run(self) -> torch.Tensor:
        """The pass over the buffers (what a graph captures): [1, total, hidden] before the final norm."""
        runner = self.runner
        hidden = runner.embed(self.ids)[None]
        with runner.attention_kernels(), engine_attention(runner.config):
            for idx in range(runner.layers.num_layers):
                with runner.layers.layer(idx) as layer:
                    hidden = runner._run_layer(layer, idx, hidden, self.group)
        return hidden

    def capture(self, pool: tuple[int, int], side: torch.cuda.Stream) -> None:
        """Warm up, then capture `run`, on the graphs' capture stream `side`: ordered after the current stream's
        work and before what it queues next, and without torch.cuda.graph's device-wide synchronize (a
        target pass may be running on another stream: thread_local lets its thread go on while this captures)."""
        current = torch.cuda.current_stream(self.runner.device)
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            self.run()  # warm-up: kernel choices, workspaces, outside the graph
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                self.hidden = self.run()
            finally:
                graph.capture_end()
        current.wait_stream(side)
        self.graph = graph

    def logits(self, group: list[Segment], hidden: torch.Tensor) -> list[torch.Tensor | None]:
        """The head over each segment's rows asked for (its logit_rows, else all its rows): [rows, vocab] float32."""
        return self.runner.head_rows(group, [i * self.bucket for i in range(len(group))], hidden)


class DraftGraphs:
    """A draft runner's static passes by shape; `forward` is forward_groups for one group, or None where the
    group has no static form (the caller runs it eagerly)."""

    def __init__(self, runner: DecoderRunner, capture: bool, layout: str | None = None):
        self.runner = runner
        self.capture = capture  # False: run the static pass eagerly (CPU; tests)
        self.layout = layout or attention_layout()
        self.passes: dict[StaticShape, StaticPass] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        # one capture stream for every pass, as torch.cuda.graph keeps one: cuBLAS keeps a workspace per (handle,
        # stream) for the process's life, so a stream per capture (up to the pool's 32) holds as many; never a
        # stream the loader or the pass's thread queues on (main_thread_stream)
        self.stream = main_thread_stream(runner.device) if capture else None
        self.failed = False  # a capture failed: every pass eager from then on
        self.mask_bytes = 0  # the passes' mask buffers together (MASK_BYTES at most)

    def forget(self) -> None:
        """Drop every pass (their graphs and the caches they hold): the caches are being replaced."""
        self.passes.clear()
        self.mask_bytes = 0

    @torch.inference_mode()
    def forward(self, group: list[Segment]) -> list[torch.Tensor | None] | None:
        static = None if self.failed else self.static_pass(group)
        if static is None:
            return None
        static.load(group)
        if not self.capture:
            return static.logits(group, static.run())
        if static.graph is None:
            try:
                static.capture(self.pool, self.stream)
            except RuntimeError as exc:  # e.g. a layer that syncs with the host (data-dependent shapes)
                self.failed = True
                self.forget()
                log.warning("draft graphs off: capturing the draft's forward failed (%s)", exc)
                return None
        static.graph.replay()
        return static.logits(group, static.hidden)

    def static_pass(self, group: list[Segment]) -> StaticPass | None:
        """The static pass for this group's shape (made on first use), or None where it has none."""
        block = group[0].cache.block
        if any(s.allowed is None or s.cache.block is not block for s in group):
            return None
        bucket = row_bucket(max(s.input_ids.shape[0] for s in group))
        spans = [kv_span(s.start_slot + bucket, block.capacity) for s in group] if bucket is not None else [None]
        if any(span is None for span in spans) or max(spans) > MAX_SPAN:  # type: ignore[type-var]
            return None
        shape = StaticShape(id(block), len(group), bucket, max(spans))  # type: ignore[arg-type, type-var]
        static = self.passes.get(shape)
        if static is None:
            blocks = len(group) ** 2 if self.layout == "block" else len(group)
            mask_bytes = blocks * bucket * shape.kv_len * self.runner.dtype.itemsize
            if len(self.passes) >= MAX_GRAPHS or self.mask_bytes + mask_bytes > MASK_BYTES:
                return None
            self.mask_bytes += mask_bytes
            static = StaticPass(self.runner, block, group[0].cache.layer_rows, len(group), bucket, shape.kv_len,
                                self.layout)
            self.passes[shape] = static
        return static
