"""CUDA graphs of a draft's tree forward: one launch for the ~1,000 kernels of a growth round's draft pass.

A small draft's forward is bound by launching its kernels, not by running them (docs/bench/gpu.md: 12-24 ms a
forward on an H200 whose device work is a millisecond or two). A graph replays them in one launch, but it
needs fixed shapes and addresses, so a graphed forward is a static form of the pass (StaticPass):
- each segment's rows padded to a bucket (ROW_BUCKETS), every segment of the group to the same one;
- each segment attends over slots [0, kv_len) of its own cache, kv_len a power of two (KV_MIN at least, the
  cache's capacity at most) past start_slot + bucket, under an additive mask that spells out the segment's
  tree (its `allowed`), every slot past it masked;
- keys and values are written with index_copy_ at slot indices held in a buffer: the padded rows write the
  slots right after the segment's, which hold nothing yet (a growth's next forward writes from its next slot
  on, past these), and attend slot 0 alone (finite rows: a masked slot's value must never be NaN);
- ids, positions, rotary cos/sin, slot indices and masks are copied into the pass's buffers before a replay;
  the final norm runs inside, the head over the rows asked for after it, eagerly (no logits buffer per graph).
Outputs equal the eager pass's up to the kernels' rounding at other shapes, so only a draft runs this way:
verification checks whatever it proposes, and the output stays the target's (tests/model/test_draft_graphs.py).

DraftGraphs keeps one graph per (caches, bucket, kv_len), captured at its first use, all in one memory pool;
a pass it cannot take (prefill chunks, no `allowed`, rows past the last bucket, no room in a cache) runs
eagerly. On a CPU the same static pass runs without capture (`capture=False`: what the CPU tests check).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.model import families
from engine.model.hf_attention import GroupInputs, engine_attention
from engine.model.kv_cache import KVCache
from engine.model.runner import DecoderRunner, ResidentLayers, Segment

log = logging.getLogger(__name__)

ROW_BUCKETS = (8, 16, 32, 64, 128)  # rows a segment is padded to; a forward of more rows runs eagerly
KV_MIN = 1024  # the smallest attended span (slots); spans double from here up to the cache's capacity
MAX_GRAPHS = 64  # graphs kept; a pass of a new shape past this runs eagerly


def row_bucket(rows: int) -> int | None:
    """The smallest bucket holding `rows`, or None past the largest."""
    return next((bucket for bucket in ROW_BUCKETS if rows <= bucket), None)


def kv_span(end: int, capacity: int) -> int | None:
    """Slots [0, span) a segment writing up to slot `end` (exclusive) attends: a power of two >= end, at least
    KV_MIN, at most `capacity`; None when `end` exceeds the capacity."""
    if end > capacity:
        return None
    return min(capacity, max(KV_MIN, 1 << (end - 1).bit_length()))


def graphable(runner: DecoderRunner) -> bool:
    """Whether the runner's pass has a static form here: resident layers, full attention in every layer
    (no sliding windows, no linear-attention layers)."""
    return isinstance(runner.layers, ResidentLayers) and runner.window_set == {None} and not any(runner.linear_layers)


class StaticSegment:
    """One segment of a StaticPass, as attend_layer reads it: its rows [row_begin, row_begin + bucket) of the
    group's block, keys and values written at `slots`, attention over slots [0, kv_len) under `mask`."""

    def __init__(self, cache: KVCache, row_begin: int, bucket: int, kv_len: int, dtype: torch.dtype, alone: bool):
        device = cache.device
        self.cache = cache
        self.slots = torch.zeros(bucket, dtype=torch.long, device=device)  # [bucket] slot of each row
        self.mask = torch.zeros(1, 1, bucket, kv_len, dtype=dtype, device=device)  # [1, 1, bucket, kv_len]
        self.masks = {None: self.mask}
        self.layer_rows = cache.layer_rows
        self.rows = slice(row_begin, row_begin + bucket)
        self.alone = alone
        _, _, keys, values = cache.grouped
        self.keys, self.values = keys[:, :, :, :kv_len], values[:, :, :, :kv_len]  # [layers, kv_heads, 1, kv_len, hd]

    def write(self, row: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """key, value [1, kv_heads, bucket, head_dim] into the slots' rows of cache row `row`."""
        self.cache.keys[row].index_copy_(1, self.slots, key[0])
        self.cache.values[row].index_copy_(1, self.slots, value[0])


@dataclass(frozen=True)
class StaticShape:
    caches: tuple[int, ...]  # id() of each segment's cache, in the group's order
    bucket: int  # rows of every segment
    kv_len: int


class StaticPass:
    """A draft pass of fixed shape over fixed caches: input buffers, the pass over them, its graph."""

    def __init__(self, runner: DecoderRunner, caches: list[KVCache], bucket: int, kv_len: int):
        device, total = runner.device, bucket * len(caches)
        self.runner, self.bucket, self.kv_len = runner, bucket, kv_len
        self.ids = torch.zeros(total, dtype=torch.long, device=device)  # [total]
        self.positions = torch.zeros(1, total, dtype=torch.long, device=device)  # [1, total]
        rotary = runner._rotary_inputs(self.positions[0], kv_len)
        self.rotary = {key: (cos.clone(), sin.clone()) for key, (cos, sin) in rotary.items()}  # [1, total, dim] each
        self.segments = [StaticSegment(cache, i * bucket, bucket, kv_len, runner.dtype, len(caches) == 1)
                         for i, cache in enumerate(caches)]
        self.group = GroupInputs(self.positions, self.rotary, self.segments, runner.dtype)  # type: ignore[arg-type]
        self.offsets = torch.arange(bucket, device=device)  # [bucket]
        self.fill = torch.finfo(runner.dtype).min
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None  # [1, total, hidden] normed: the captured pass's output

    def load(self, group: list[Segment]) -> None:
        """The group's ids, positions, slots and masks into the buffers (each segment's rows from row i * bucket)."""
        self.ids.zero_()
        self.positions.zero_()
        for i, (s, static) in enumerate(zip(group, self.segments, strict=True)):
            begin, num = i * self.bucket, s.input_ids.shape[0]
            self.ids[begin : begin + num].copy_(s.input_ids)
            self.positions[0, begin : begin + num].copy_(s.position_ids)
            torch.add(self.offsets, s.start_slot, out=static.slots)
            static.mask.fill_(self.fill)
            static.mask[0, 0, :num, : s.start_slot + num].masked_fill_(s.allowed, 0.0)
            if num < self.bucket:
                static.mask[0, 0, num:, 0] = 0.0  # padded rows attend slot 0: finite keys and values
            s.cache.write_positions(s.start_slot, s.position_ids)
        for key, (cos, sin) in self.runner._rotary_inputs(self.positions[0], self.kv_len).items():
            self.rotary[key][0].copy_(cos)
            self.rotary[key][1].copy_(sin)

    def run(self) -> torch.Tensor:
        """The pass over the buffers (what a graph captures): [1, total, hidden], after the final norm."""
        runner = self.runner
        hidden = runner.embed(self.ids)[None]
        with runner.attention_kernels(), engine_attention(runner.config):
            for idx in range(runner.layers.num_layers):
                with runner.layers.layer(idx) as layer:
                    hidden = runner._run_layer(layer, idx, hidden, self.group)
        return runner.norm(hidden)

    def capture(self, pool: tuple[int, int]) -> None:
        """Warm up on a side stream (kernel choices, workspaces), then capture `run` into a graph."""
        side = torch.cuda.Stream(self.runner.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the target's pass may be running in another thread (overlap) while this captures
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self.hidden = self.run()
        self.graph = graph

    def logits(self, group: list[Segment], hidden: torch.Tensor) -> list[torch.Tensor | None]:
        """The head over each segment's rows asked for (its logit_rows, else all its rows): [rows, vocab] float32."""
        runner, rows, counts = self.runner, [], []
        for i, s in enumerate(group):
            begin, num = i * self.bucket, s.input_ids.shape[0]
            wanted = torch.arange(begin, begin + num, device=hidden.device)
            if s.logit_rows is not None:
                wanted = wanted[s.logit_rows]
            rows.append(wanted)
            counts.append(wanted.shape[0])
        if sum(counts) == 0:
            return [None] * len(group)
        selected = hidden[0].index_select(0, torch.cat(rows))  # [sum(counts), hidden]
        logits = families.scale_logits(runner.family, runner.config, runner.lm_head(selected)).float()
        return [part if count else None for part, count in zip(logits.split(counts), counts, strict=True)]


class DraftGraphs:
    """A draft runner's static passes by shape; `forward` is forward_groups for one group, or None where the
    group has no static form (the caller runs it eagerly)."""

    def __init__(self, runner: DecoderRunner, capture: bool):
        self.runner = runner
        self.capture = capture  # False: run the static pass eagerly (CPU; tests)
        self.passes: dict[StaticShape, StaticPass] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.failed = False  # a capture failed: every pass eager from then on

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
                static.capture(self.pool)
            except RuntimeError as exc:  # e.g. a layer that syncs with the host (data-dependent shapes)
                self.failed = True
                log.warning("draft graphs off: capturing the draft's forward failed (%s)", exc)
                return None
        static.graph.replay()
        return static.logits(group, static.hidden)

    def static_pass(self, group: list[Segment]) -> StaticPass | None:
        """The static pass for this group's shape (made on first use), or None where it has none."""
        if any(s.allowed is None for s in group):
            return None
        bucket = row_bucket(max(s.input_ids.shape[0] for s in group))
        if bucket is None:
            return None
        spans = [kv_span(s.start_slot + bucket, s.cache.capacity) for s in group]
        if any(span is None for span in spans):
            return None
        kv_len = max(spans)  # type: ignore[type-var]
        if any(kv_len > s.cache.capacity for s in group):
            return None
        shape = StaticShape(tuple(id(s.cache) for s in group), bucket, kv_len)
        static = self.passes.get(shape)
        if static is None:
            if len(self.passes) >= MAX_GRAPHS:
                return None
            static = self.passes[shape] = StaticPass(self.runner, [s.cache for s in group], bucket, kv_len)
        return static
