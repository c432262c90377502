"""CUDA graphs of the vision tower: one per patch-count bucket, all sharing one memory pool.

Why: launching the tower from Python costs milliseconds of host time per step whatever its size
(~10 ms eager on an H200, a few ms compiled), holding the GIL the other threads need, and a lone
image's step would be launch-bound. A replay is one launch.

How a packed step of n patches fits a graph captured for N >= n patches:
  * inputs live in static device buffers (the engine's, allocated once); rows n..N-1 hold stale but
    valid values from earlier steps (zeros at first);
  * cu_seqlens has a fixed length: the step's images, then the padding rows n..N-1 cut into
    segments of at most PAD_SEGMENT rows (attention never mixes them with real images, and their
    quadratic cost stays small), then zero-length segments up to the fixed length;
  * varlen attention takes max_seqlen = N, an upper bound it only uses to size its grid.
Output rows of the real images are exactly the first n/4 rows of the graph's output.

Buckets are close together (a sixteenth of the size apart, see graph_buckets) so padding wastes at
most ~6% of a step: padding to 1024-patch buckets measured 20-30% slower than exact sizes.

Equal steps: k images of one common size (the --graph-exact-sides, k = 1..--graph-exact-images) also get a graph with
batched attention (one [k, heads, L, dim] call, no cu_seqlens). Measured inside CUDA graphs on an
H200, 784 patches per image: varlen flash 20.9 us per block at k=1 and 111 us at k=8, batched cuDNN
14.1 and 73.6 us. A step of the same patch count whose
images differ in size takes the varlen graph of that bucket.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch

from service.engine.tower import AttentionKind, TowerBatch, VisionTower

log = logging.getLogger(__name__)

PAD_SEGMENT = 1024  # rows per padding segment (at most; bucket gaps are smaller, see graph_buckets)
MIN_BUCKET_STEP = 64  # patches; every image's patch count is a multiple of 4 (the 2x2 merge)


def graph_buckets(max_patches: int, limit: int, smallest: int = 256) -> list[int]:
    """Patch counts to capture, from `smallest` to min(limit, max_patches), each a sixteenth or less
    above the previous one (steps of 64 patches up to 2048, then 128, 256, ... per octave).
    `smallest` is the fewest patches a step can have (one image of the minimum size). Steps of equal
    common images get graphs of their own (equal_steps), unpadded."""
    top = min(limit, max_patches)
    out, n = [], max(MIN_BUCKET_STEP, smallest - smallest % MIN_BUCKET_STEP)
    while n < top:
        out.append(n)
        n += max(MIN_BUCKET_STEP, 1 << max(0, n.bit_length() - 5))
    return sorted(set([*out, top])) if top > 0 else []


def equal_steps(max_bucket: int, exact: tuple[int, ...] = (), exact_images: int = 64) -> list[tuple[int, int]]:
    """(images, patches per image) of the equal steps that get a batched-attention graph: 1..exact_images
    images of each common size (`exact`: their patch counts), up to the largest bucket. The steps light
    traffic makes most often (a few equal images) then run unpadded. (A step of unequal images that sums to
    one of these sizes pads to the next bucket: varlen graphs of these sizes as well would cost 28 more at start.)"""
    return sorted({(k, p) for p in exact if p > 0 for k in range(1, exact_images + 1) if p * k <= max_bucket})


def pad_segments(max_bucket_gap: int) -> int:
    return -(-max_bucket_gap // PAD_SEGMENT)


def padded_cu_seqlens(seq_lens: list[int], bucket: int, length: int) -> list[int]:
    """cu_seqlens of a step padded to `bucket` rows and `length` entries (see the module docstring)."""
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    assert cu[-1] <= bucket, f"{cu[-1]} patches do not fit bucket {bucket}: this is a bug"
    while cu[-1] < bucket:
        cu.append(min(bucket, cu[-1] + PAD_SEGMENT))
    assert len(cu) <= length, f"cu_seqlens needs {len(cu)} entries, room for {length}: this is a bug"
    return cu + [bucket] * (length - len(cu))


@dataclass
class StaticInputs:
    """The engine's device buffers the graphs read (allocated once, at maximum size)."""

    patches: torch.Tensor  # [max_patches, 3*P*P] model dtype
    pos_hw: torch.Tensor  # [max_patches, 2] int64
    interp_idx: torch.Tensor  # [max_patches, 4] int64
    interp_w: torch.Tensor  # [max_patches, 4] float32
    cu_seqlens: torch.Tensor  # [cu_length] int32 — padded layout


class GraphKey(NamedTuple):
    """Which captured graph runs a step: a padded bucket or an equal step."""

    patches: int  # rows the graph computes: the bucket (a step pads up to it), or the equal step's own
    attention: AttentionKind  # VARLEN: a padded bucket, any images; BATCHED: an equal step, unpadded
    images: int  # BATCHED: the equal step's images, patches / images each; VARLEN: 0 (a bucket takes any count)

    @classmethod
    def bucket(cls, patches: int) -> GraphKey:
        return cls(patches, AttentionKind.VARLEN, 0)

    @classmethod
    def equal(cls, images: int, per_image: int) -> GraphKey:
        return cls(images * per_image, AttentionKind.BATCHED, images)

    @property
    def padded(self) -> bool:
        """A bucket's graph: the step's rows are padded up to `patches` (and cu_seqlens with them)."""
        return self.attention == AttentionKind.VARLEN


class TowerGraphs:
    """Captured replays of `tower`: one per bucket (varlen attention, padded) and one per equal step
    (batched attention). `graph_for(seq_lens)` picks one, `run(key)` replays it and returns a view of
    the one static output buffer ([patches/4, out_width]); the next replay overwrites it, so copy what
    you need first."""

    def __init__(self, tower: VisionTower, inputs: StaticInputs, buckets: list[int], stream: torch.cuda.Stream,
                 smallest: int, equal: list[tuple[int, int]] = ()):
        """`smallest`: the fewest patches an image can have; it bounds how many segments a bucket holds.
        `equal`: (images, patches per image) steps to capture with batched attention (see equal_steps)."""
        self.tower, self.inputs, self.buckets, self.stream = tower, inputs, buckets, stream
        self.equal = {GraphKey.equal(k, p): p for k, p in equal}  # key -> patches per image
        self.cu_length = inputs.cu_seqlens.shape[0]
        # Each graph reads only the cu_seqlens entries its bucket can need (images that fit, one padding
        # segment, the leading 0): varlen attention launches work per segment, empty ones included,
        # and 65 mostly-empty segments cost a one-image step ~0.3 ms on an H200.
        # +2: one padding segment (bucket gaps are below PAD_SEGMENT) and the leading 0.
        self._cu_len = {b: min(self.cu_length, b // max(1, smallest) + 2) for b in buckets}
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        # NOTE: every graph writes its result into this one buffer (a copy inside the graph), so the
        # pool keeps one output, not one per bucket: with ~70 buckets that is gigabytes saved.
        keys = [GraphKey.bucket(b) for b in buckets] + list(self.equal)
        top = max(k.patches for k in keys)
        self.out = torch.empty(top // 4, tower.spec.out_width, dtype=inputs.patches.dtype, device=inputs.patches.device)
        pool = torch.cuda.graph_pool_handle()
        # Largest first: later (smaller) captures reuse the pool's blocks instead of growing it. (Sorted on
        # the ints: an Enum has no order; an equal step goes before the bucket of its size, as it always did.)
        with torch.inference_mode():
            inputs.interp_idx.zero_()  # padding rows must index the position table validly
            for key in sorted(keys, key=lambda k: (k.patches, k.images), reverse=True):
                n = key.patches
                cu = [0] + [n] * (self.cu_length - 1)  # any valid layout: capture records shapes
                inputs.cu_seqlens.copy_(torch.tensor(cu, dtype=torch.int32))
                batch = self._batch(key)
                with torch.cuda.stream(stream):
                    tower(batch)  # warm-up outside the graph: kernels chosen, workspaces allocated
                stream.synchronize()
                # NOTE: capture_begin/end, not the torch.cuda.graph context manager: that one runs
                # gc.collect() and empty_cache() before every capture, which after torch.compile took
                # ~0.8 s per graph on an H200 (a minute for all buckets), for nothing here.
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.stream(stream):
                    graph.capture_begin(pool=pool)
                    try:
                        self.out[: n // 4].copy_(tower(batch))
                    finally:
                        graph.capture_end()
                self._graphs[key] = graph
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs of the tower (buckets %d..%d patches, %d equal steps)", len(keys),
                 buckets[0], buckets[-1], len(self.equal))

    def __len__(self) -> int:
        return len(self._graphs)

    def _batch(self, key: GraphKey) -> TowerBatch:
        i, n = self.inputs, key.patches
        if not key.padded:  # an equal step: batched attention, cu_seqlens unused
            per = self.equal[key]
            return TowerBatch(i.patches[:n], i.pos_hw[:n], i.interp_idx[:n], i.interp_w[:n],
                              i.cu_seqlens[: key.images + 1], seq_lens=(per,) * key.images,
                              attention=AttentionKind.BATCHED)
        return TowerBatch(i.patches[:n], i.pos_hw[:n], i.interp_idx[:n], i.interp_w[:n],
                          i.cu_seqlens[: self._cu_len[n]], seq_lens=(n,), max_seqlen=n, attention=AttentionKind.VARLEN)

    def graph_for(self, seq_lens: tuple[int, ...]) -> GraphKey | None:
        """The graph for a step of images of these patch counts: its equal-step graph if it has one,
        else the smallest bucket holding them, else None (run the tower without a graph)."""
        key = GraphKey.equal(len(seq_lens), seq_lens[0])
        if key in self.equal and all(x == seq_lens[0] for x in seq_lens):
            return key
        b = self.bucket_for(sum(seq_lens))
        return None if b is None else GraphKey.bucket(b)

    def bucket_for(self, num_patches: int) -> int | None:
        """The smallest padded bucket holding `num_patches`, or None."""
        for b in self.buckets:
            if b >= num_patches:
                return b
        return None

    def cu_len(self, bucket: int) -> int:
        """cu_seqlens entries the graph of `bucket` reads (a prefix of the staged padded layout)."""
        return self._cu_len[bucket]

    def run(self, key: GraphKey) -> torch.Tensor:
        self._graphs[key].replay()  # on the stream it was captured on
        return self.out[: key.patches // 4]
