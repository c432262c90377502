"""Fused rotary position embedding of q and k, straight from the qkv projection (CUDA, Triton).

One program per patch row reads the row's q and k (the first 2*H*D columns of qkv), its cos and sin
once, and writes the rotated q and k in model dtype; the math is float32, like the reference:

    out = x * cos + rotate_half(x) * sin  ==  x * cos + cat(x2, x1) * [-sin_half, sin_half]

Why a hand-written kernel: Inductor's fused version of this (measured on an H200) ran at
~1.4 TB/s on an H200, 10.7 ms of an 84 ms batch-64 forward, for ~0.44 GB moved per block. Here each
row's cos/sin is loaded once for its 2*H head vectors and every access is a contiguous row.

Triton ships with every CUDA build of torch; it is imported only where it exists (not on CPU-only
installs, where the tower uses its plain-torch rotary). Registered with torch.library.triton_op so
torch.compile traces through it (no graph break) and CUDA graphs capture it.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch: no Triton, and no need for it
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _rotary_qk_kernel(qkv_ptr, cos_ptr, sin_ptr, out_ptr, row_stride, HEADS2: tl.constexpr, HALF: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, HEADS2)[:, None]  # q's heads, then k's: [2H, 1]
        c = tl.arange(0, HALF)[None, :]  # [1, D/2]
        src = qkv_ptr + n * row_stride + j * (2 * HALF) + c
        x1 = tl.load(src).to(tl.float32)
        x2 = tl.load(src + HALF).to(tl.float32)
        trig = n * (2 * HALF) + c
        cos1 = tl.load(cos_ptr + trig)
        cos2 = tl.load(cos_ptr + trig + HALF)
        sin1 = tl.load(sin_ptr + trig)  # sin carries rotate_half's sign: [-s, s]
        sin2 = tl.load(sin_ptr + trig + HALF)
        dst = out_ptr + n * (HEADS2 * 2 * HALF) + j * (2 * HALF) + c
        tl.store(dst, (x1 * cos1 + x2 * sin1).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"))
        tl.store(dst + HALF, (x2 * cos2 + x1 * sin2).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"))

    @torch.library.triton_op("qve::rotary_qk", mutates_args={})
    def _rotary_qk_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> torch.Tensor:
        n, d = qkv.shape[0], cos.shape[1]
        out = torch.empty((n, 2, num_heads, d), dtype=qkv.dtype, device=qkv.device)
        torch.library.wrap_triton(_rotary_qk_kernel)[(n,)](qkv, cos, sin, out, qkv.stride(0), HEADS2=2 * num_heads,
                                                          HALF=d // 2, num_warps=4)
        return out


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def supports(num_heads: int, head_dim: int) -> bool:
    """Whether the kernel handles this head layout (its block shape needs powers of two)."""
    return available() and _pow2(2 * num_heads) and _pow2(head_dim // 2) and head_dim % 2 == 0


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rotate q and k of a qkv projection. Returns [N, 2, H, D] (q then k), qkv's dtype, contiguous.

    qkv: [N, 3*H*D] bf16/fp16 on CUDA, last dim contiguous (q, k, v blocks of H*D columns each)
    cos: [N, D] float32, contiguous; sin: [N, D] float32 with rotate_half's sign folded in ([-s, s])
    """
    if not available():
        raise RuntimeError("rotary_qk needs Triton (a CUDA build of torch); use the tower's torch rotary")
    if qkv.dim() != 2 or not qkv.is_cuda or qkv.dtype not in (torch.bfloat16, torch.float16) or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be a 2-D bf16/fp16 CUDA tensor with contiguous rows, got {qkv.dtype} "
                         f"{tuple(qkv.shape)} on {qkv.device}")
    d = cos.shape[-1]
    if qkv.shape[1] != 3 * num_heads * d or not supports(num_heads, d):
        raise ValueError(f"qkv has {qkv.shape[1]} columns; expected 3 * {num_heads} heads * {d} (powers of two)")
    for name, t in (("cos", cos), ("sin", sin)):
        if (t.dtype != torch.float32 or t.dim() != 2 or t.shape[0] != qkv.shape[0] or t.shape[1] != d
                or not t.is_contiguous() or t.device != qkv.device):
            raise ValueError(f"{name} must be a contiguous float32 [N, {d}] tensor on {qkv.device}")
    return _rotary_qk_op(qkv, cos, sin, num_heads)
