"""The runner: the tower, the pinned staging pool, the device buffers, the CUDA graphs and the output
ring of one device. No threads, no batcher, no store: the step loop calls it, one step at a time.

    with runner.stage(items) as staged:   # host: pixels + geometry into pinned slot k (after its fence)
        launched = runner.run(staged)     # device: H2D, patchify, tower, async D2H; returns at once

`run` never waits on the device for its own sake. Its only host waits are
  * the slot fence: before overwriting pinned slot k, wait for the CUDA event recorded after the
    last device work that read slot k (the bug this service exists to avoid: recycling a pinned
    input buffer while an earlier step's H2D copy still reads it), and
  * back-pressure from the writer when all output buffers (pool.OutputRing) are still being written
    to the store.
On CPU the same code runs: events are trivial and the "device" work is synchronous.

A step's items are images, then videos (PreparedVideo: a whole video or a run of its temporal groups).
A video's temporal group k is its frames 2k and 2k+1: patchified like an image's frame but with the
video normalization table (video_preprocess.video_lut), frame 2k into the patch rows (after every
image's), frame 2k+1 into the tower's `frame1` rows; one attention segment per group (tower.segments).
The staged entry table holds the images, then every group's first frame, then every group's second,
so each of the three is one contiguous slice for the patchify kernel. A step with video runs eagerly:
CUDA graphs take seq_lens only, and a video's could equal an image step's.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from service.config import FAULT_ENV, FaultInjection, RunnerOptions
from service.media.images import PreparedImage
from service.media.params import VideoParams
from service.media.video_preprocess import PreparedVideo, video_lut
from service.engine.loader import LoadedModel
from service.engine.pool import OutputLease, OutputRing, Slot, StagingPool, StepBuffers, StepSize
from service.media.preprocess import grid_for, normalize_lut, num_patches, patch_rows, patchify
from service.engine import attention, tower as tower_module
from service.engine.graphs import (GraphKey, StaticInputs, TowerGraphs, equal_steps, graph_buckets, pad_segments,
                                   padded_cu_seqlens)
from service.engine.tower import AttentionKind, TowerBatch, build_batch, grid_geometry, segments

log = logging.getLogger(__name__)


def fast_tower(model: LoadedModel) -> bool:
    """Whether the tower can take CUDA graphs and torch.compile: bf16/fp16 on CUDA (varlen attention);
    elsewhere it runs eagerly (CPU float32 stays exactly transformers' arithmetic)."""
    return (model.device.type == "cuda" and model.dtype in (torch.bfloat16, torch.float16)
            and tower_module.varlen_available())


def use_compile_cache(model: LoadedModel, options: RunnerOptions) -> None:
    """For an entry point, before it builds the Engine of `model` (the Runner writes no environment):
    point Inductor's and Triton's on-disk caches at options.compile_cache (unless the user set them), so
    a restart loads compiled kernels instead of compiling again. Nothing where the Runner won't compile."""
    if not (options.compile and fast_tower(model)):
        return
    path = os.path.abspath(os.path.expanduser(str(options.compile_cache)))
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", path)
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(path, "triton"))


@dataclass(kw_only=True)
class Staged:
    """Step inputs written into pinned slot `slot`; sizes are host ints (no device syncs needed)."""

    slot: Slot  # held until `run` has enqueued the last device work that reads it
    size: StepSize  # what the step filled of slot.buffers; its patches are the images' rows (a graph pads beyond)
    graph: GraphKey | None  # the CUDA graph that runs the step (see TowerGraphs), or None
    seq_lens: tuple[int, ...]  # [S] patches per attention segment (an image, or one video group)
    token_offsets: list[int]  # [B+1] output-row offsets per item
    grids: list[tuple[int, int, int]]  # [B] (t, h, w) patch grid per item
    image_entries: int = 0  # entries [0, image_entries) of the staged table are the images
    groups: int = 0  # then `groups` first frames of video groups, then their `groups` second frames
    video_row: int = 0  # the first video patch row (every row before it is an image's)


@dataclass(kw_only=True)
class Launched:
    """A step whose device work is enqueued; `host_out` is valid once `done` has fired. Images in
    staging order. Whoever reads `host_out` last releases `output` (the writer; encode_sync)."""

    host_out: torch.Tensor  # [tokens, out_width] model dtype, pinned on CUDA: rows of output.host
    done: torch.cuda.Event | None  # None on CPU (already complete)
    output: OutputLease | None  # the ring buffer host_out lies in, held until released (CUDA only)
    token_offsets: list[int]  # [B+1] output-row offsets per image
    grids: list[tuple[int, int, int]]  # [B] (t, h, w) patch grid per image
    output_wait_s: float = 0.0  # host time `run` waited for a free output buffer (the writer behind)
    # Timing events on the compute stream around the step's device work (H2D, patchify, tower), read by the
    # writer once `done` has fired: the device's own time per step (the `device` step phase). None on CPU.
    device_span: tuple[torch.cuda.Event, torch.cuda.Event] | None = None


class Runner:
    """Owns the tower, the staging pool and the device buffers; runs one step at a time (no threads)."""

    def __init__(self, model: LoadedModel, options: RunnerOptions):
        """Loads nothing and reads no environment: `model` is loaded, `options` derived from Settings
        (Settings.runner_options). Its start-up, in named steps: size the steps, allocate every buffer,
        and where the tower is fast plan the attention kernels, compile and capture CUDA graphs (an entry
        point calls use_compile_cache first). `startup`: the seconds of each, for the log and /ready."""
        self.model = model
        self.device = model.device
        self.cuda = self.device.type == "cuda"
        self.startup: dict[str, float] = {}
        fast = fast_tower(model)
        self._size(options, fast)
        self._allocate(options)
        if fast:
            self._timed("attention_s", self._plan_attention, options.attention)
        if fast and options.compile:
            self._timed("compile_s", self._compile)
        self.graphs = self._timed("graph_capture_s", self._capture) if self.buckets else None
        if self.graphs is not None:
            self.startup["graphs"] = len(self.graphs)
        self.test_stall_cycles = 0  # tests only: a device sleep queued before each step's H2D copies
        self._inject_faults(options.faults)

    # ---- start-up, step by step ---------------------------------------------------------------------
    def _timed(self, phase: str, step, *args):
        t0 = time.perf_counter()
        out = step(*args)
        self.startup[phase] = round(time.perf_counter() - t0, 2)
        return out

    def _size(self, options: RunnerOptions, fast: bool) -> None:
        """What a step may hold (patches, images, video groups), its buffers' capacity, and the CUDA graphs'
        buckets and equal steps."""
        spec, params = self.model.spec, self.model.params
        merge2 = spec.merge_size**2
        pp = spec.patch_size**2
        # A step holds up to the token budget, or one image above it (such an image runs alone), or one
        # temporal group of the largest video frame (a longer video is split across steps by the loop).
        self.max_patches = max(options.max_batch_tokens * merge2, params.max_pixels // pp,
                               max_group_patches(self.model.video))
        self.max_images = options.max_batch_images
        if self.max_patches > tower_module.max_block_rows(spec):
            raise ValueError(f"a step of {self.max_patches} patches is more than the tower can index "
                             f"({tower_module.max_block_rows(spec)}); lower --max-batch-tokens or --max-pixels")
        self.smallest = params.min_pixels // pp  # patches of the smallest image preprocessing produces
        exact = tuple(num_patches(grid_for(side, side, params)) for side in options.graph_exact_sides)
        self.buckets = graph_buckets(self.max_patches, options.graph_max_patches, self.smallest) if (
            fast and options.cuda_graphs) else None
        self.equal_steps = equal_steps(self.buckets[-1], exact, options.graph_exact_images) if self.buckets else []
        # cu_seqlens has room for every image plus the padding segments of the widest bucket gap.
        gaps = [b - a for a, b in zip([0, *self.buckets], self.buckets)] if self.buckets else [0]
        self.cu_length = self.max_images + 1 + pad_segments(max(gaps))
        # Video: a group holds at least merge**2 patches, so a step has at most this many groups; each is
        # two frames of pixels (the pixel bytes double) and two entries of the table. The graphs see only
        # the image layout's cu_length prefix of cu_seqlens; a video step writes its own segments.
        self.max_groups = self.max_patches // merge2
        self.capacity = StepSize(pixel_bytes=2 * self.max_patches * pp * 3, images=self.max_images + 2 * self.max_groups,
                                 patches=self.max_patches, cu_seqlens=self.cu_length + self.max_groups)

    def _allocate(self, options: RunnerOptions) -> None:
        """Every buffer a step uses, once: the pinned staging pool and, on a GPU, its device mirrors, the patch
        rows, the streams and the output ring."""
        model, spec = self.model, self.model.spec
        self.pool = StagingPool(self.capacity, options.pool_slots, self.device)
        # numpy views of every slot's buffers, made once: staging is plain memcpy into them.
        self._np = [self.pool.slot(i).buffers.numpy() for i in range(options.pool_slots)]
        self.lut_np = normalize_lut(model.params)  # [3, 256] float32, exact per-level values
        self.lut = torch.from_numpy(self.lut_np).to(self.device)
        self.video_lut = torch.from_numpy(video_lut(model.video)).to(self.device)  # [3, 256] float32: not the image's
        if not self.cuda:
            return
        from qve_kernels.patchify import copy_async, patchify_cuda  # CuPy is only needed (and imported) on GPU

        self._patchify_cuda, self._copy_async = patchify_cuda, copy_async
        # Device mirrors of the slot buffers and the patch rows: allocated once, sliced per step.
        # Zeros, not empty: a graph's padding rows read them, and must index the position table validly.
        self.dev = StepBuffers.allocate(self.capacity, self.device, zeros=True)
        self._h2d = [_copy_table(self.pool.slot(i).buffers, self.dev) for i in range(options.pool_slots)]
        self.patches = torch.zeros(self.max_patches, spec.frame_patch_dim, dtype=model.dtype, device=self.device)
        # The second frame of each video row (TowerBatch.frame1): allocated once, at the step's size.
        self.frame1 = torch.zeros(self.max_patches, spec.frame_patch_dim, dtype=model.dtype, device=self.device)
        self.compute_stream = torch.cuda.Stream(self.device)
        self.copy_stream = torch.cuda.Stream(self.device)
        # Output ring: as many pinned buffers as slots; the writer gives each back when stored.
        self.outputs = OutputRing(options.pool_slots, self.max_patches // spec.merge_size**2, spec.out_width,
                                  model.dtype, self.device)
        # Launched steps whose device work may still run (loop thread only; see steps_in_flight).
        self._in_flight: collections.deque[torch.cuda.Event] = collections.deque(maxlen=self.outputs.depth)

    def _plan_attention(self, forced: str) -> None:
        """Each step's attention kernel: measured on this GPU (`auto`), or the one --attention forces."""
        model, spec = self.model, self.model.spec
        model.tower.attention_plan = attention.plan_for(forced, self.device, model.dtype, spec.num_heads, spec.head_dim)
        log.info("attention: %s (%s; FA3 %s; FA4 %s)", model.tower.attention_plan.describe(),
                 "measured" if forced == "auto" else f"--attention {forced}", attention.fa3_status(),
                 attention.fa4_status())

    def _compile(self) -> None:
        if not self.model.tower.compiled:  # several engines may share one loaded model (tests)
            self.model.tower.compile()
        self._warm_compiled(self.smallest, batch_of_one=bool(self.equal_steps))

    def _capture(self) -> TowerGraphs:
        d = self.dev
        return TowerGraphs(self.model.tower, StaticInputs(self.patches, d.pos_hw, d.interp_idx, d.interp_w,
                                                          d.cu_seqlens[: self.cu_length]),
                           self.buckets, self.compute_stream, self.smallest, self.equal_steps)

    def _inject_faults(self, faults: FaultInjection) -> None:
        """The test-only faults of the soak's control run (see FaultInjection). Never in service."""
        if faults == FaultInjection():
            return
        self.test_stall_cycles = faults.stall_cycles if self.cuda else 0  # a CPU step has no device to lag
        self.pool.fence = faults.fence
        log.warning("FAULT INJECTION ON (%s): stall %d cycles before each step's copies, fence %s; "
                    "embeddings may be wrong", FAULT_ENV, self.test_stall_cycles, "on" if self.pool.fence else "OFF")

    def steps_in_flight(self) -> int:
        """How many launched steps may still run on the device, their output copies included (the batcher's
        continuous-batching test). Loop thread only. CPU steps are synchronous: always 0."""
        if not self.cuda:
            return 0
        q = self._in_flight
        while q and q[0].query():
            q.popleft()
        return len(q)

    def _warm_compiled(self, smallest: int, batch_of_one: bool) -> None:
        """Compile now, at start-up, every graph the step loop can call: varlen (one image, and what
        CUDA graphs capture), batched (equal-size images) and, when equal-step graphs will be
        captured, batched attention of one image (torch.compile specialises a size of 1), each with
        every kernel the attention plan can pick for it. A first compile in the middle of serving
        would stall the loop for seconds."""
        side = max(2, int(smallest**0.5) // 2 * 2)  # an even square grid near the smallest image
        spec, plan = self.model.spec, self.model.tower.attention_plan
        steps = [(1, AttentionKind.VARLEN), (2, AttentionKind.BATCHED)]
        if batch_of_one:
            steps.append((1, AttentionKind.BATCHED))
        for count, kind in steps:
            grids = [(1, side, side)] * count
            arr = build_batch(grids, spec)
            n = side * side * count
            d = self.dev
            for name in ("pos_hw", "interp_idx", "interp_w"):
                getattr(d, name)[:n].copy_(torch.from_numpy(arr[name]))
            d.cu_seqlens[: count + 1].copy_(torch.from_numpy(arr["cu_seqlens"]))
            self.patches[:n].normal_()
            for backend in sorted(plan.backends(kind), key=lambda b: b.value):
                batch = TowerBatch(self.patches[:n], d.pos_hw[:n], d.interp_idx[:n], d.interp_w[:n],
                                   d.cu_seqlens[: count + 1], tuple([side * side] * count), attention=kind,
                                   backend=backend)
                with torch.cuda.stream(self.compute_stream), torch.inference_mode():
                    self.model.tower(batch)
        self.compute_stream.synchronize()

    # ---- the step ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def stage(self, items: Sequence[PreparedImage | PreparedVideo]) -> Iterator[Staged]:
        """Host: write one step's items (images, then videos: pixels and geometry) into the next pinned
        slot (after its fence), for `run` inside the block. `run` releases the slot at its fence point; if
        anything raises before that, the slot is released on the way out of the block (see StagingPool.acquired)."""
        with self.pool.acquired() as slot:  # blocks until the device has finished reading this slot's last step
            yield self._stage_into(slot, items)

    def _stage_into(self, slot: Slot, items: Sequence[PreparedImage | PreparedVideo]) -> Staged:
        bufs = self._np[slot.index]
        spec = self.model.spec
        merge2 = spec.merge_size**2
        images = [x for x in items if not isinstance(x, PreparedVideo)]
        videos = items[len(images):]
        assert all(isinstance(v, PreparedVideo) for v in videos), "a step's images come before its videos: this is a bug"
        off = row = 0
        seq_lens, grids, token_offsets = [], [], [0]

        def place(gh: int, gw: int, at: int) -> None:  # one frame's positions at patch row `at`
            geo = grid_geometry(gh, gw, spec.merge_size, spec.num_position_embeddings)
            n = gh * gw
            bufs.pos_hw[at : at + n] = geo.pos_hw
            bufs.interp_idx[at : at + n] = geo.interp_idx
            bufs.interp_w[at : at + n] = geo.interp_w

        for i, img in enumerate(images):
            t, gh, gw = img.grid_thw
            assert t == 1, f"an image of grid {img.grid_thw}: this is a bug"
            h, w = img.pixels.shape[:2]
            n_bytes, n_patches = img.pixels.size, gh * gw
            assert row + n_patches <= self.max_patches and i < self.max_images, "batch over staging capacity: this is a bug"
            bufs.pixels[off : off + n_bytes] = img.pixels.reshape(-1)
            bufs.images[i] = (off, h, w, row)
            place(gh, gw, row)
            off += n_bytes
            row += n_patches
            seq_lens.append(n_patches)
            grids.append((t, gh, gw))
            token_offsets.append(token_offsets[-1] + n_patches // merge2)
        ni, video_row = len(images), row
        total_groups = sum(v.grid_thw[0] for v in videos)
        assert total_groups <= self.max_groups, f"{total_groups} video groups in one step: this is a bug"
        g = 0  # groups staged so far; group g's frames are entries ni + g and ni + total_groups + g
        for v in videos:
            t, gh, gw = v.grid_thw
            nf, h, w, _ = v.frames.shape
            assert nf == 2 * t and v.frames.dtype.itemsize == 1, f"{nf} frames for {t} groups: this is a bug"
            n_patches, frame_bytes = gh * gw, h * w * 3
            assert row + t * n_patches <= self.max_patches, "batch over staging capacity: this is a bug"
            bufs.pixels[off : off + v.frames.size] = v.frames.reshape(-1)
            for k in range(t):
                rel = row - video_row  # the same row of `patches[video_row:]` and of `frame1`
                bufs.images[ni + g] = (off + 2 * k * frame_bytes, h, w, rel)
                bufs.images[ni + total_groups + g] = (off + (2 * k + 1) * frame_bytes, h, w, rel)
                place(gh, gw, row)  # every group repeats the frame's positions
                row += n_patches
                g += 1
            off += v.frames.size
            seq_lens.extend(segments(v.grid_thw))
            grids.append(v.grid_thw)
            token_offsets.append(token_offsets[-1] + t * n_patches // merge2)
        if videos:  # eager, never a graph; cu_seqlens is just the segments
            graph, cu_entries = None, len(seq_lens) + 1
            bufs.cu_seqlens[:cu_entries] = np.cumsum([0, *seq_lens])
        else:
            graph = self.graphs.graph_for(tuple(seq_lens)) if self.graphs else None
            padded = graph.patches if graph and graph.padded else row  # a varlen graph's bucket; else no padding
            cu = padded_cu_seqlens(seq_lens, padded, self.cu_length)
            if graph and graph.padded:
                used = cu.index(padded) + 1  # real segments, padding, the leading 0
                assert used <= self.graphs.cu_len(padded), f"{used} cu_seqlens entries for bucket {padded}: this is a bug"
            cu_entries = self.cu_length
            bufs.cu_seqlens[:cu_entries] = cu
        size = StepSize(pixel_bytes=off, images=ni + 2 * total_groups, patches=row, cu_seqlens=cu_entries)
        return Staged(slot=slot, size=size, graph=graph, seq_lens=tuple(seq_lens), token_offsets=token_offsets,
                      grids=grids, image_entries=ni, groups=total_groups, video_row=video_row)

    def run(self, st: Staged) -> Launched:
        """Device: inputs -> patch rows -> tower -> async copy to host. Returns without waiting."""
        return self._run_cuda(st) if self.cuda else self._run_cpu(st)

    def _run_cpu(self, st: Staged) -> Launched:
        b, n, ni, g = st.slot.buffers, st.size.patches, st.image_entries, st.groups
        spec = self.model.spec

        def frame(entry: int) -> torch.Tensor:  # [h, w, 3] uint8, a view of the slot
            off, h, w, _ = (int(x) for x in b.images[entry])
            return b.pixels[off : off + h * w * 3].view(h, w, 3)

        def video_rows(entries: range) -> list[torch.Tensor]:
            return [patch_rows(frame(e)[None], self.video_lut, spec.patch_size, spec.merge_size, 1) for e in entries]

        rows = [patchify(frame(i), self.lut, self.model.params) for i in range(ni)] + video_rows(range(ni, ni + g))
        batch = TowerBatch(
            patches=torch.cat(rows).to(self.model.dtype),
            pos_hw=b.pos_hw[:n], interp_idx=b.interp_idx[:n], interp_w=b.interp_w[:n],
            cu_seqlens=b.cu_seqlens[: len(st.seq_lens) + 1], seq_lens=st.seq_lens,
            frame1=torch.cat(video_rows(range(ni + g, ni + 2 * g))).to(self.model.dtype) if g else None,
        )
        with torch.inference_mode():
            out = self.model.tower(batch)
        # CPU work is synchronous: the slot is free again. (If anything above raised, `stage` released it.)
        st.slot.release()
        return Launched(host_out=out, done=None, output=None, token_offsets=st.token_offsets, grids=st.grids)

    def _run_cuda(self, st: Staged) -> Launched:
        slot, n, nbytes = st.slot, st.size.patches, st.size.pixel_bytes
        ni, g, vrow = st.image_entries, st.groups, st.video_row
        d = self.dev
        span = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        with torch.cuda.stream(self.compute_stream), torch.inference_mode():
            span[0].record(self.compute_stream)
            try:
                if self.test_stall_cycles:  # a slow device, for the fence tests: the H2D copies run late
                    torch.cuda._sleep(self.test_stall_cycles)
                self._copy_async(_copies(self._h2d[slot.index], st.size), self.compute_stream)
            finally:
                # The H2D copies above are the last device work that reads slot k: fence it here.
                slot.release(self.compute_stream)
            patches = self.patches[:n]
            sizes = dict(patch_size=self.model.spec.patch_size, merge_size=self.model.spec.merge_size)
            self._patchify_cuda(d.pixels[:nbytes], d.images[:ni], self.lut, self.patches[:vrow], **sizes)
            if g:  # each group's first frames after the images' rows, its second frames into frame1
                self._patchify_cuda(d.pixels[:nbytes], d.images[ni : ni + g], self.video_lut, self.patches[vrow:n],
                                    **sizes)
                self._patchify_cuda(d.pixels[:nbytes], d.images[ni + g : ni + 2 * g], self.video_lut,
                                    self.frame1[: n - vrow], **sizes)
            tokens = st.token_offsets[-1]
            if st.graph is not None:
                # One launch for the whole tower. The graph's output is static and the next replay
                # overwrites it: take a device copy (cheap) for the D2H to read.
                out = self.graphs.run(st.graph)[:tokens].clone()
            else:
                batch = TowerBatch(patches, d.pos_hw[:n], d.interp_idx[:n], d.interp_w[:n],
                                   d.cu_seqlens[: len(st.seq_lens) + 1], st.seq_lens,
                                   frame1=self.frame1[: n - vrow] if g else None)
                out = self.model.tower(batch)
            span[1].record(self.compute_stream)
        t_out = time.perf_counter()
        output = self.outputs.acquire()  # back-pressure: only blocks when the writer is pool_slots steps behind
        output_wait_s = time.perf_counter() - t_out
        host, done = output.host[:tokens], output.done
        self.copy_stream.wait_stream(self.compute_stream)
        with torch.cuda.stream(self.copy_stream):
            host.copy_(out, non_blocking=True)
            done.record(self.copy_stream)
        self._in_flight.append(done)
        # `out` was allocated on compute_stream and is read on copy_stream: keep the allocator from reusing it early.
        out.record_stream(self.copy_stream)
        return Launched(host_out=host, done=done, output=output, token_offsets=st.token_offsets, grids=st.grids,
                        output_wait_s=output_wait_s, device_span=span)


def _copy_table(src: StepBuffers[torch.Tensor], dst: StepBuffers[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(dst pointer, src pointer, bytes per row) of each buffer, in field order: made once per slot, so
    a step's copies are plain integer arithmetic (see qve_kernels.patchify.copy_async for why raw copies)."""
    return [(d.data_ptr(), s.data_ptr(), s[:1].nbytes) for s, d in zip(src.values(), dst.values())]


def _copies(table: list[tuple[int, int, int]], size: StepSize) -> list[tuple[int, int, int]]:
    """The raw copies (dst, src, bytes) that move what a step of `size` filled: one per buffer, of the
    rows StepSize.rows gives it (in the same field order as the table)."""
    return [(dst, src, row_bytes * rows) for (dst, src, row_bytes), rows in zip(table, size.rows().values())]


def max_group_patches(video: VideoParams) -> int:
    """An upper bound on the patches of one temporal group (one frame) of any video these params give:
    clip_size keeps the whole clip (two frames or more) within max_pixels, or (the per-frame cap) a frame
    within the cap, or lifts a tiny clip to min_pixels (rounded up to whole merge blocks: the slack)."""
    frame = max(video.max_pixels // 2, int(video.min_pixels * 1.05) + 1)
    if video.cap_pixels_per_frame:
        frame = max(frame, video.max_video_tokens * video.factor**2)
    side = video.factor
    return (frame + 4 * side * int(frame**0.5) + 4 * side * side) // video.patch_size**2
