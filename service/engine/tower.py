"""The Qwen3-VL vision tower, written for serving.

Same architecture and the same state-dict names as transformers' `Qwen3VLVisionModel` (so released
checkpoints load with `strict=True` and transformers is the reference in tests), but shaped for a
step loop:
  * every per-batch index (rotary positions, learned-position interpolation taps, cu_seqlens) is
    computed on the host from grid_thw and arrives as a tensor: no `.tolist()` / `repeat_interleave`
    host syncs inside the forward;
  * the patch embedding is a Linear over one frame (768 wide) with the Conv3d weights summed over
    t: both temporal frames of an image are equal, so this is the same function on half the input.
    A video's temporal group has two different frames: its rows (the last of a step) take the Conv3d
    itself, as two Linears, one per frame (the t=0 and t=1 weight slices), over `patches` and
    `frame1`. Otherwise a group is an image of grid (1, h, w): the same positions, and attention
    within the group only (see segments);
  * rotary is applied to q and k together, straight from the qkv projection, in float32 math with
    model-dtype in/out: one Triton kernel on CUDA (kernels/qve_kernels/rotary.py; the eager chain was a third of
    the tower's time on an H200), the plain torch formula on the CPU;
  * attention is chosen per step on the host, from host integers (no device sync): its layout (one
    batched call when every image has the same length, the packed batch otherwise on CUDA, a
    per-image loop elsewhere) and its kernel, from a plan measured on the device (attention.py);
  * `--dtype fp8` (quantize_fp8): the chosen GEMMs (qkv by default) of all but the kept blocks in FP8
    with row-wise scales, the activations quantised inside the compiled block;
  * the block is one function of its weights (`_make_block_fn`): `compile()` wraps it in torch.compile
    with dynamic shapes, so one compiled graph per attention kind serves every block and every step
    size (and the CUDA graphs captured from it); GELU runs in the cuBLASLt GEMM epilogue on CUDA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from qve_kernels import rotary as rotary_kernel
from service.engine.attention import (AttentionKind, AttentionPlan, Attn, Backend, attend,  # noqa: F401 (re-exported)
                                      varlen_available)


@dataclass(frozen=True)
class TowerSpec:
    """What the rest of the service needs to know about a tower (plain ints, no tensors)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    deepstack_indexes: tuple[int, ...]
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    num_position_embeddings: int
    rope_theta: float

    @classmethod
    def from_config(cls, cfg) -> "TowerSpec":
        rope = getattr(cfg, "rope_parameters", None) or {}
        return cls(
            depth=cfg.depth,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_heads=cfg.num_heads,
            out_hidden_size=cfg.out_hidden_size,
            deepstack_indexes=tuple(cfg.deepstack_visual_indexes),
            patch_size=cfg.patch_size,
            merge_size=cfg.spatial_merge_size,
            temporal_patch_size=cfg.temporal_patch_size,
            num_position_embeddings=cfg.num_position_embeddings,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def deepstack_levels(self) -> int:
        return len(self.deepstack_indexes)

    @property
    def out_width(self) -> int:
        """Columns of one image's stored tensor: main embeddings, then each deepstack tap."""
        return self.out_hidden_size * (1 + self.deepstack_levels)

    @property
    def frame_patch_dim(self) -> int:
        return 3 * self.patch_size * self.patch_size


# ---------------------------------------------------------------------------------------------------
# Host-side geometry: everything the forward needs that depends only on an image's grid.
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GridGeometry:
    """Per-patch indices for one (grid_h, grid_w), rows in merge-block order (h/2, w/2, 2, 2)."""

    pos_hw: np.ndarray  # [n, 2] int64 — (row, col) of each patch, for the 2-D rotary embedding
    interp_idx: np.ndarray  # [n, 4] int64 — taps into the learned square position table
    interp_w: np.ndarray  # [n, 4] float32 — bilinear (align_corners=True) weights of those taps


@lru_cache(maxsize=4096)
def grid_geometry(grid_h: int, grid_w: int, merge: int, num_position_embeddings: int) -> GridGeometry:
    """Cached: real traffic repeats a few hundred grid shapes, and this is pure index arithmetic."""
    side = int(math.isqrt(num_position_embeddings))
    rows = torch.arange(grid_h).view(grid_h // merge, merge, 1, 1).expand(-1, -1, grid_w // merge, merge)
    cols = torch.arange(grid_w).view(1, 1, grid_w // merge, merge).expand(grid_h // merge, merge, -1, -1)
    # (bh, mh, bw, mw) -> (bh, bw, mh, mw): each 2x2 merge block contiguous
    row = rows.permute(0, 2, 1, 3).reshape(-1)
    col = cols.permute(0, 2, 1, 3).reshape(-1)

    def taps(index: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        # bilinear, align_corners=True: endpoints map to 0 and side-1 (same float32 ops as transformers)
        src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
        lo = torch.floor(src)
        t = torch.stack([lo, lo + 1], dim=1).long().clamp(0, side - 1)
        w = (1 - (src[:, None] - lo[:, None] - torch.arange(2)).abs()).clamp(min=0)
        return t, w

    h_t, h_w = taps(row, grid_h)
    w_t, w_w = taps(col, grid_w)
    idx = (h_t[:, :, None] * side + w_t[:, None, :]).reshape(-1, 4)
    wts = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    pos_hw = torch.stack([row, col], dim=1)
    return GridGeometry(pos_hw.numpy(), idx.numpy(), wts.to(torch.float32).numpy())


def segments(grid_thw: tuple[int, int, int]) -> tuple[int, ...]:
    """Patch counts of the attention segments of one image or video, in row order: one per temporal
    group (transformers' cu_seqlens = repeat_interleave(h*w, t)); an image is one."""
    t, h, w = grid_thw
    assert t >= 1, f"grid {grid_thw} has no temporal group: this is a bug"
    return (h * w,) * t


def step_segments(grids: list[tuple[int, int, int]]) -> tuple[int, ...]:
    """`TowerBatch.seq_lens` of a step of these grids, in order: each one's segments."""
    return tuple(n for g in grids for n in segments(g))


class GroupRange(NamedTuple):
    """Temporal groups [start, stop) of one video, as a step encodes them on their own."""

    grid: tuple[int, int, int]  # (stop - start, h, w): what build_batch and segments take
    rows: slice  # the groups' patch rows among the video's T*h*w
    tokens: slice  # their output rows among the video's T*h*w / merge**2


def video_groups(grid_thw: tuple[int, int, int], start: int, stop: int, merge_size: int) -> GroupRange:
    """Where groups [start, stop) of a video lie. Groups never attend to each other and their positions
    repeat, so these groups encoded in any step (as grid (stop - start, h, w)) give exactly the rows
    `tokens` of the whole video's output: a long video can be split across steps at group boundaries."""
    t, h, w = grid_thw
    assert 0 <= start < stop <= t, f"groups [{start}, {stop}) of a {t}-group video: this is a bug"
    n, per_token = h * w, merge_size**2
    return GroupRange((stop - start, h, w), slice(start * n, stop * n),
                      slice(start * n // per_token, stop * n // per_token))


@dataclass
class TowerBatch:
    """One packed step, on the tower's device: images, then videos, back to back in every tensor.
    An attention segment is an image or one temporal group of a video (see segments)."""

    patches: torch.Tensor  # [N, 3*P*P] model dtype — one frame's patch rows (a group's first), merge-block order
    pos_hw: torch.Tensor  # [N, 2] int64
    interp_idx: torch.Tensor  # [N, 4] int64
    interp_w: torch.Tensor  # [N, 4] float32
    cu_seqlens: torch.Tensor  # [S+1] int32 — patch offsets of each segment (graphs: padded, see graphs.py)
    seq_lens: tuple[int, ...]  # [S] host copy of the per-segment patch counts (no device sync to split)
    max_seqlen: int | None = None  # host upper bound on a segment's length (CUDA graphs pass their bucket)
    attention: AttentionKind | None = None  # VARLEN or BATCHED forced on a fast device (graphs); None: attention_kind
    # [Nv, 3*P*P] model dtype — the SECOND frame of each of the LAST Nv patch rows (video temporal
    # groups); None: every row is an image. (The staging kernel's 768-wide rows, once per frame.)
    frame1: torch.Tensor | None = None
    # The attention kernel, forced (start-up compiles each one the plan can pick); None: the tower's
    # attention_plan picks by the longest segment.
    backend: Backend | None = None


def attention_kind(b: TowerBatch, device: torch.device, dtype: torch.dtype) -> AttentionKind:
    """Pick the attention call for a step from host integers only (never a device sync).

    `b.attention` forces VARLEN or BATCHED on a fast device (CUDA graphs choose per graph; a forced
    BATCHED needs equal lengths).
    NOTE: unforced, a single image goes through varlen, not a batch of one: under torch.compile a
    batch size of 1 is specialised into a compiled graph of its own, compiled at start-up only for
    the graphs that use it (Runner._warm_compiled)."""
    lens = b.seq_lens
    fast = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and varlen_available()
    equal = all(n == lens[0] for n in lens)
    if fast and b.attention is not None:
        assert b.attention == AttentionKind.VARLEN or equal, "batched attention needs equal lengths: this is a bug"
        return b.attention
    if equal and len(lens) >= 2:
        return AttentionKind.BATCHED
    return AttentionKind.VARLEN if fast else AttentionKind.LOOP


# ---------------------------------------------------------------------------------------------------
# Modules (attribute names mirror transformers' Qwen3VLVisionModel for strict state-dict loading)
# ---------------------------------------------------------------------------------------------------
class _PatchEmbed(nn.Module):
    def __init__(self, spec: TowerSpec):
        super().__init__()
        k = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        self.proj = nn.Conv3d(3, spec.hidden_size, kernel_size=k, stride=k, bias=True)


class _BlockWeights(NamedTuple):
    """One block's tensors, handed to the block function as inputs (see _make_block_fn). In an FP8 block
    (quantize_fp8) qkv_w, fc1_w and fc2_w are float8_e4m3fn, one scale per output row in *_s."""

    norm1_w: torch.Tensor
    norm1_b: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    proj_w: torch.Tensor
    proj_b: torch.Tensor
    norm2_w: torch.Tensor
    norm2_b: torch.Tensor
    fc1_w: torch.Tensor
    fc1_b: torch.Tensor
    fc2_w: torch.Tensor
    fc2_b: torch.Tensor
    qkv_s: torch.Tensor | None = None  # [1, out] float32: FP8 blocks only
    fc1_s: torch.Tensor | None = None
    fc2_s: torch.Tensor | None = None


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_GEMMS = ("qkv", "fc1", "fc2")  # the block GEMMs that can run in FP8 (proj cannot gain: see the block)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8: x [M, K] -> (float8_e4m3fn [M, K], float32 [M, 1]) with x ~= q * scale. Each row's
    largest magnitude maps to FP8_MAX. Under torch.compile this fuses into the op that made x (the
    layernorm, the GELU): a stand-alone pass costs as much as the FP8 GEMM saves (probed on an H200)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x @ w.T + bias with x quantised row-wise and w [out, in] float8 with per-row scales w_scale
    [1, out]: one cuBLASLt FP8 GEMM (scales and bias in its epilogue), output in x's dtype. On the CPU
    (tests only: the service refuses fp8 there) the same quantised values in a float32 matmul."""
    q, x_scale = quantize_rows(x)
    if x.is_cuda:
        return torch._scaled_mm(q, w.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=x.dtype,
                                use_fast_accum=True)
    out = (q.float() * x_scale) @ (w.float() * w_scale.t()).t() + bias.float()
    return out.to(x.dtype)


def max_block_rows(spec: TowerSpec) -> int:
    """The most patch rows one step may hold: every activation of a block stays under 2**31 elements."""
    return (2**31 - 1) // max(3 * spec.hidden_size, spec.intermediate_size)


def _make_block_fn(num_heads: int, head_dim: int, eps: float, max_rows: int):
    """One vision block as a function of its inputs and its weights.

    NOTE: a function of the weights, not a module method, so torch.compile traces ONE graph that all
    blocks share (the weights are graph inputs): compiling the 24-27 block tower as a whole took ~2
    minutes on an H200, one block a few seconds. Head count and eps are closure constants; every int
    argument is symbolic under dynamic=True."""
    scale = head_dim**-0.5
    fused_rotary = rotary_kernel.supports(num_heads, head_dim)

    def block(x, r, cos, sin, cu_seqlens, max_seqlen: int, batch: int, kind: AttentionKind, backend: Backend,
              seq_lens: tuple[int, ...] | None, w: _BlockWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, r) -> (x', r'): the block's input is x + r, its output x' + r'. The MLP's residual add is
        left to the next block, where it fuses into that block's first layernorm: a block ending on it
        made it a pass of its own over the rows, 2.7 of the tower's ~75 ms at 448px x 64. The
        tower's wall time moved less: 1.004x at 448px x 64, 1.020x at 1024px x 16 (with _step_tables)."""
        n, hidden = x.shape
        # Tells torch.compile the rows' upper bound, so its generated kernels can index with 32-bit
        # integers (with an unbounded symbolic size it falls back to slower 64-bit index math).
        torch._check(n <= max_rows)
        x = x + r
        h = F.layer_norm(x, (hidden,), w.norm1_w, w.norm1_b, eps)
        # FP8 GEMMs where the block's weights carry scales (quantize_fp8): a guard under torch.compile, so
        # bf16 blocks and each FP8 variant compile apart
        if w.qkv_s is not None:
            qkv = fp8_linear(h, w.qkv_w, w.qkv_s, w.qkv_b)  # the quantisation fuses into the layernorm
        else:
            qkv = F.linear(h, w.qkv_w, w.qkv_b)  # [N, 3*H*D]: q, k, v
        if fused_rotary and qkv.is_cuda and qkv.dtype in (torch.float16, torch.bfloat16):
            qk = rotary_kernel.rotary_qk(qkv, cos, sin, num_heads)  # one Triton kernel, [N, 2, H, D]
        else:
            qk = _rotary(qkv.view(n, 3, num_heads, head_dim)[:, :2], cos, sin)
        q, k = qk.unbind(1)  # [N, H, D] each
        qkv = qkv.view(n, 3, num_heads, head_dim)
        o = attend(q, k, qkv[:, 2], Attn(kind, backend, cu_seqlens, max_seqlen, batch, seq_lens), scale)  # [N, H, D]
        # proj stays bf16: its input comes out of the attention kernel, so its quantisation cannot fuse
        # into an op before it, and alone it costs what the FP8 GEMM saves (probed on an H200).
        x = x + F.linear(o.reshape(n, hidden), w.proj_w, w.proj_b)
        h = F.layer_norm(x, (hidden,), w.norm2_w, w.norm2_b, eps)
        if w.fc1_s is not None:
            h = F.gelu(fp8_linear(h, w.fc1_w, w.fc1_s, w.fc1_b), approximate="tanh")  # no FP8 GELU epilogue
        elif h.is_cuda:
            # GELU (tanh, = gelu_pytorch_tanh) in cuBLASLt's GEMM epilogue: one pass over the widest
            # activation saved. (On the CPU this op's GELU is the erf one, so not there.)
            h = torch._addmm_activation(w.fc1_b, h, w.fc1_w.t(), use_gelu=True)
        else:
            h = F.gelu(F.linear(h, w.fc1_w, w.fc1_b), approximate="tanh")  # gelu_pytorch_tanh
        if w.fc2_s is not None:
            return x, fp8_linear(h, w.fc2_w, w.fc2_s, w.fc2_b)  # the quantisation fuses into the GELU
        return x, F.linear(h, w.fc2_w, w.fc2_b)

    return block


class _Attention(nn.Module):
    def __init__(self, spec: TowerSpec):
        super().__init__()
        self.qkv = nn.Linear(spec.hidden_size, 3 * spec.hidden_size, bias=True)
        self.proj = nn.Linear(spec.hidden_size, spec.hidden_size)


class _MLP(nn.Module):
    def __init__(self, spec: TowerSpec):
        super().__init__()
        self.linear_fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=True)


class _Block(nn.Module):
    """Holds one block's parameters under transformers' names; the math is _make_block_fn's."""

    def __init__(self, spec: TowerSpec):
        super().__init__()
        self.norm1 = nn.LayerNorm(spec.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(spec.hidden_size, eps=1e-6)
        self.attn = _Attention(spec)
        self.mlp = _MLP(spec)

    def weights(self) -> _BlockWeights:
        a, m = self.attn, self.mlp
        return _BlockWeights(self.norm1.weight, self.norm1.bias, a.qkv.weight, a.qkv.bias, a.proj.weight, a.proj.bias,
                             self.norm2.weight, self.norm2.bias, m.linear_fc1.weight, m.linear_fc1.bias,
                             m.linear_fc2.weight, m.linear_fc2.bias)


class _Merger(nn.Module):
    """2x2 patch merge to the LM width. Deepstack mergers normalise after the shuffle, the main one before."""

    def __init__(self, spec: TowerSpec, postshuffle_norm: bool):
        super().__init__()
        self.width = spec.hidden_size * spec.merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.width if postshuffle_norm else spec.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, spec.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle_norm else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """Qwen3-VL vision tower. `forward(TowerBatch) -> [tokens, out_hidden * (1 + deepstack levels)]`."""

    def __init__(self, spec: TowerSpec):
        super().__init__()
        self.spec = spec
        self.patch_embed = _PatchEmbed(spec)
        self.pos_embed = nn.Embedding(spec.num_position_embeddings, spec.hidden_size)
        self.blocks = nn.ModuleList(_Block(spec) for _ in range(spec.depth))
        self.merger = _Merger(spec, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(_Merger(spec, postshuffle_norm=True) for _ in spec.deepstack_indexes)
        # Rotary inverse frequencies: head_dim/4 of them, shared by the row and column axes.
        quarter = spec.head_dim // 2
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # Derived from patch_embed.proj after the weights are loaded (see fuse_patch_embed).
        self.register_buffer("frame_proj_weight", torch.empty(0), persistent=False)  # [hidden, 3*P*P]: summed over t
        self.register_buffer("video_proj_weight", torch.empty(0), persistent=False)  # [T, hidden, 3*P*P]: per frame
        self._block_fn = _make_block_fn(spec.num_heads, spec.head_dim, eps=1e-6, max_rows=max_block_rows(spec))
        self._block_weights: list[_BlockWeights] = []  # filled by fuse_patch_embed, after loading
        self._compiled = None  # torch.compile'd _block_fn, once compile() was called
        self._compiled_tables = None  # and _step_tables
        # Which kernel runs each step's attention (see attention.py): the fallback until the engine
        # measures a plan on its device (attention.measure_plan) or --attention forces one.
        self.attention_plan = AttentionPlan()
        self.fp8_blocks: tuple[int, ...] = ()  # blocks whose GEMMs run in FP8 (quantize_fp8)
        self.fp8_gemms: tuple[str, ...] = ()  # which of their GEMMs

    @torch.no_grad()
    def fuse_patch_embed(self) -> None:
        """Call after loading weights: Conv3d over (t, p, p) on a frame repeated over t == Linear with
        the weights summed over t. Summed in float32, then cast to the model dtype. For video rows, the
        Conv3d itself: one Linear per frame, its weight the slice at that t (columns (c, py, px), as a
        frame's patch row). Also collects each block's weight tensors for the block function (they
        never change after loading)."""
        w = self.patch_embed.proj.weight  # [hidden, 3, T, P, P]
        self.frame_proj_weight = w.float().sum(dim=2).reshape(w.shape[0], -1).to(w.dtype).contiguous()
        self.video_proj_weight = w.permute(2, 0, 1, 3, 4).reshape(w.shape[2], w.shape[0], -1).contiguous()
        self._block_weights = [blk.weights() for blk in self.blocks]
        self.fp8_blocks, self.fp8_gemms = (), ()

    @torch.no_grad()
    def quantize_fp8(self, keep: tuple[int, ...] = (), gemms: tuple[str, ...] = FP8_GEMMS) -> None:
        """Call after fuse_patch_embed: the `gemms` weights (of qkv, fc1, fc2) of every block not in `keep`
        to float8_e4m3fn, one scale per output row, once. The block function then runs those GEMMs in FP8
        (fp8_linear). The patch embedding, proj, the mergers and the `keep` blocks stay in the model
        dtype: published FP8 recipes for this ViT keep the first blocks and the mergers in bf16, where
        trained weights have massive-activation channels. The bf16 parameters are kept (state dict)."""
        assert self._block_weights, "fuse_patch_embed() first: this is a bug"
        assert gemms and set(gemms) <= set(FP8_GEMMS), f"FP8 GEMMs {gemms}: this is a bug"
        quantized = []
        for i, w in enumerate(self._block_weights):
            if i in keep:
                quantized.append(w)
                continue
            change = {}
            for g in gemms:
                q, s = quantize_rows(getattr(w, f"{g}_w"))
                change[f"{g}_w"], change[f"{g}_s"] = q, s.t().contiguous()
            quantized.append(w._replace(**change))
        self._block_weights = quantized
        self.fp8_blocks = tuple(i for i in range(len(quantized)) if i not in keep)
        self.fp8_gemms = tuple(g for g in FP8_GEMMS if g in gemms) if self.fp8_blocks else ()

    def compile(self) -> None:
        """Run the blocks through torch.compile (Inductor) from now on: rotary, layernorms, residuals
        and GELU become fused kernels around the cuBLAS GEMMs and the attention call (and the step's
        position and rotary tables, _step_tables, a kernel or two).

        dynamic=True: the step's patch count, segment count, batch size and max_seqlen are symbolic,
        so each (attention layout, kernel, bf16 or FP8 block) compiles once and serves every step size; fullgraph=True: a graph
        break would silently leave part of the block eager, so it is an error instead."""
        # One compiled graph per (layout, kernel, bf16/FP8 block, batch of one): more than dynamo's
        # default of 8 recompiles per function, after which it would silently run the block eagerly.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self._compiled = torch.compile(self._block_fn, dynamic=True, fullgraph=True)
        self._compiled_tables = torch.compile(_step_tables, dynamic=True, fullgraph=True)

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def forward(self, b: TowerBatch) -> torch.Tensor:
        assert self.frame_proj_weight.numel() > 0, "fuse_patch_embed() was not called after loading: this is a bug"
        kind = attention_kind(b, b.patches.device, b.patches.dtype)
        # Arguments a kind does not use are fixed at 0 / None: torch.compile specialises on them, and a
        # varying unused value (or a 1) would compile another graph.
        max_seqlen = (b.max_seqlen or max(b.seq_lens)) if kind == AttentionKind.VARLEN else 0
        batch = len(b.seq_lens) if kind == AttentionKind.BATCHED else 0
        seq_lens = b.seq_lens if kind == AttentionKind.LOOP else None
        backend = b.backend or self.attention_plan.choose(kind, max(b.seq_lens))  # LOOP: always SDPA
        block_fn = self._compiled if (self._compiled is not None and kind != AttentionKind.LOOP) else self._block_fn

        if b.frame1 is None:  # images only: the fast path (and every CUDA graph)
            x = F.linear(b.patches, self.frame_proj_weight, self.patch_embed.proj.bias)
        else:
            x = self._embed_with_video(b)
        tables = self._compiled_tables if block_fn is self._compiled else _step_tables
        # r: the position embedding, added in the first block (see _make_block_fn: x + r is each block's input)
        r, cos, sin = tables(self.pos_embed.weight, b.interp_idx, b.interp_w, b.pos_hw, self.inv_freq, x.dtype)

        taps = []
        for i, w in enumerate(self._block_weights):
            x, r = block_fn(x, r, cos, sin, b.cu_seqlens, max_seqlen, batch, kind, backend, seq_lens, w)
            if i in self.spec.deepstack_indexes:
                taps.append(self.deepstack_merger_list[self.spec.deepstack_indexes.index(i)](x + r))
        return torch.cat([self.merger(x + r), *taps], dim=1)

    def _embed_with_video(self, b: TowerBatch) -> torch.Tensor:
        """The patch embedding of a step whose last Nv rows are video groups: [N, hidden] model dtype.
        Image rows through the summed weight, video rows through Conv3d's t=0 slice on `patches` plus
        its t=1 slice on `frame1`; written into one output (no cat of the whole step)."""
        frame1, patches, bias = b.frame1, b.patches, self.patch_embed.proj.bias
        n, nv = patches.shape[0], frame1.shape[0]
        assert self.spec.temporal_patch_size == 2, "video rows carry two frames per group: this is a bug"
        assert 0 < nv <= n and frame1.shape[1] == patches.shape[1] and frame1.dtype == patches.dtype, (
            f"frame1 {tuple(frame1.shape)} {frame1.dtype} for patches {tuple(patches.shape)} {patches.dtype}: "
            "this is a bug")
        ni = n - nv
        w0, w1 = self.video_proj_weight.unbind(0)  # [hidden, 3*P*P] each
        x = patches.new_empty(n, self.spec.hidden_size)
        if ni:
            torch.addmm(bias, patches[:ni], self.frame_proj_weight.t(), out=x[:ni])
        video = x[ni:]
        torch.addmm(bias, patches[ni:], w0.t(), out=video)
        video.addmm_(frame1, w1.t())
        return x


def _step_tables(pos_weight: torch.Tensor, interp_idx: torch.Tensor, interp_w: torch.Tensor, pos_hw: torch.Tensor,
                 inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's per-row tables: the interpolated position embedding [N, hidden] in `dtype` (summed over its
    four taps in float32), and the rotary cos and signed sin [N, D] float32. Compiled (VisionTower.compile),
    the gather, products and sum are one kernel (0.54 ms of a 448px x 64 step; eagerly 1.4 ms in three)."""
    pos = (F.embedding(interp_idx, pos_weight) * interp_w[:, :, None]).sum(1)  # [N, hidden] float32
    freqs = pos_hw[..., None].float() * inv_freq  # [N, 2, D/4]
    half = freqs.flatten(1)  # [N, D/2]: row freqs then column freqs
    cos = torch.cat([half, half], dim=-1).cos()  # [N, D] float32
    s = half.sin()
    # rotate_half(x) * sin == cat(x2, x1) * cat(-sin, sin): the sign folded into sin once per step
    # (exactly equal in IEEE arithmetic) instead of a negation per block.
    return pos.to(dtype), cos, torch.cat([-s, s], dim=-1)


def _rotary(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of q and k at once. qk: [N, 2, H, D] (a view of qkv) -> [N, 2, H, D]
    in qk's dtype; math in float32 like the reference (bf16 rotary loses precision on large grids).
    `sin` carries rotate_half's sign: [-sin, sin]."""
    x = qk.float()
    x1, x2 = x.chunk(2, dim=-1)
    out = x * cos[:, None, None, :] + torch.cat((x2, x1), dim=-1) * sin[:, None, None, :]
    return out.to(qk.dtype)


def build_batch(grids: list[tuple[int, int, int]], spec: TowerSpec) -> dict[str, np.ndarray]:
    """Host arrays for a batch of grids, concatenated (used by tests, benchmarks and start-up): a video
    of grid (t, h, w) is t groups, each with the geometry of (h, w) and a segment of its own. The
    matching `TowerBatch.seq_lens` is `step_segments(grids)`."""
    geos = [(t, grid_geometry(h, w, spec.merge_size, spec.num_position_embeddings)) for (t, h, w) in grids]
    return {
        "pos_hw": np.concatenate([np.tile(g.pos_hw, (t, 1)) for t, g in geos]),
        "interp_idx": np.concatenate([np.tile(g.interp_idx, (t, 1)) for t, g in geos]),
        "interp_w": np.concatenate([np.tile(g.interp_w, (t, 1)) for t, g in geos]),
        "cu_seqlens": np.concatenate([[0], np.cumsum(step_segments(grids))]).astype(np.int32),
    }
