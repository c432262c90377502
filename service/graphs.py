"""CUDA graphs of the vision tower: one per patch-count bucket, all sharing one memory pool.

Why: launching the tower eagerly is ~500 kernel launches from Python, ~15-25 ms of host time per
step whatever the batch size. That holds the GIL the event loop and the store writers need, so under
HTTP load steps stay small and the service is host-bound (bench/RESULTS.md). A replay is one launch.

How a packed step of n patches fits a graph captured for N >= n patches:
  * inputs live in static device buffers (the engine's, allocated once); rows n..N-1 hold stale but
    valid values from earlier steps (zeros at first);
  * cu_seqlens has a fixed length: the step's images, then the padding rows n..N-1 cut into
    segments of at most PAD_SEGMENT rows (attention never mixes them with real images, and their
    quadratic cost stays small), then zero-length segments up to the fixed length;
  * varlen attention takes max_seqlen = N, an upper bound it only uses to size its grid.
Output rows of the real images are exactly the first n/4 rows of the graph's output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .tower import TowerBatch, VisionTower

log = logging.getLogger(__name__)

PAD_SEGMENT = 1024  # rows per padding segment
# NOTE: measured on H200s with the 4B tower (bench/RESULTS.md, bench/bench_graphs.py): a replay beats
# the eager tower for steps of 1-2 images of 448x448 (1 image: 4.3 ms vs 9.6-16.0 ms, launch-bound),
# ties at 3 and loses from 4 on (padding rows and empty attention blocks cost more than the launches
# saved). Larger steps run eagerly, where ~10-20 ms of launching overlaps the GPU work.
GRAPH_MAX_PATCHES = 3072


def graph_buckets(max_patches: int, limit: int = GRAPH_MAX_PATCHES) -> list[int]:
    """Patch counts to capture: every PAD_SEGMENT patches up to min(limit, max_patches), so a step
    that fits a graph wastes less than one padding segment."""
    top = min(limit, max_patches)
    out = list(range(PAD_SEGMENT, top, PAD_SEGMENT))
    return [*out, top]


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


class TowerGraphs:
    """Captured replays of `tower` for every bucket. `run(bucket)` returns the bucket's static output
    ([bucket/4, out_width]); it is overwritten by the next replay, so copy what you need first."""

    def __init__(self, tower: VisionTower, inputs: StaticInputs, buckets: list[int], stream: torch.cuda.Stream):
        self.tower, self.inputs, self.buckets, self.stream = tower, inputs, buckets, stream
        self.cu_length = inputs.cu_seqlens.shape[0]
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        # Largest first: later (smaller) captures reuse the pool's blocks instead of growing it.
        with torch.inference_mode():
            inputs.interp_idx.zero_()  # padding rows must index the position table validly
            for bucket in sorted(buckets, reverse=True):
                cu = [0] + [bucket] * (self.cu_length - 1)  # any valid layout: capture records shapes
                inputs.cu_seqlens.copy_(torch.tensor(cu, dtype=torch.int32))
                batch = self._batch(bucket)
                with torch.cuda.stream(stream):
                    tower(batch)  # warm-up outside the graph: kernels chosen, workspaces allocated
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = tower(batch)
                self._graphs[bucket] = (graph, out)
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs of the tower (buckets %d..%d patches)", len(buckets), buckets[0], buckets[-1])

    def _batch(self, bucket: int) -> TowerBatch:
        i = self.inputs
        return TowerBatch(i.patches[:bucket], i.pos_hw[:bucket], i.interp_idx[:bucket], i.interp_w[:bucket],
                          i.cu_seqlens, seq_lens=(bucket,), max_seqlen=bucket)

    def bucket_for(self, num_patches: int) -> int | None:
        """The smallest captured bucket holding `num_patches`, or None: run the tower eagerly."""
        for b in self.buckets:
            if b >= num_patches:
                return b
        return None

    def run(self, bucket: int) -> torch.Tensor:
        graph, out = self._graphs[bucket]
        graph.replay()  # on the stream it was captured on
        return out
