"""The tower's attention: which kernel runs a step's attention, chosen per step from a plan measured on
the device at start-up.

Two things are decided per step, on the host, from host integers (never a device sync):
  * the layout (AttentionKind, from the segments' lengths; see tower.attention_kind): one batched call
    when every segment has the same length, the packed batch with cu_seqlens otherwise, or a per-segment
    loop where no packed kernel runs (the CPU);
  * the backend (Backend, from the AttentionPlan): which kernel runs that layout.

    layout    backends
    BATCHED   cuDNN's fused kernel, FA3 dense (the optional `fa3` extra), FA4 dense (the optional `fa4`
              extra), SDPA (its own pick: flash)
    VARLEN    FA3 varlen, FA4 varlen, FA2 (torch's varlen_attn)
    LOOP      SDPA, once per segment

Why measured, not fixed: on an H200 (16 heads x 64) cuDNN ran 273-288 TFLOP/s for 64
segments of 784 patches against FA3 dense's 240, while for 4 segments of 8,160 FA3 dense ran 530 against
cuDNN's 411; varlen FA3 beat FA2 at every length probed (215-490 against 203-300). On an H100
FA4 ran segments of 1,600 patches and more 0.4-8% faster than FA3, and of 784 1-3% slower. The winner
changes with the segment length and with the build of each library, so the engine times every backend it
can run at a ladder of lengths (measure_plan, about 3 s with FA3 and FA4) and each step takes the winner at
its longest segment's length. A backend that fails to run, or disagrees with float32 SDPA, is left out of the plan.
"""

from __future__ import annotations

import enum
import logging
import math
import statistics
import sys
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

try:  # torch >= 2.10 on CUDA; absent or unusable elsewhere (then the packed layout is not used)
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - depends on the torch build
    _varlen_attn = None

log = logging.getLogger(__name__)


class AttentionKind(enum.Enum):
    """The layout of a step's attention, decided on the host per step (see tower.attention_kind)."""

    VARLEN = "varlen"  # the packed batch with cu_seqlens, one segment per image or group (CUDA, bf16/fp16)
    BATCHED = "batched"  # one [B, L, heads, dim] call: every segment of the step has the same length
    LOOP = "loop"  # one SDPA call per segment (where varlen is not: the CPU, float32 on CUDA; never compiled)


class Backend(enum.Enum):
    """The kernel that runs a layout."""

    SDPA = "sdpa"  # F.scaled_dot_product_attention (BATCHED: PyTorch picks flash / efficient; LOOP)
    CUDNN = "cudnn"  # cuDNN's fused attention, called directly (BATCHED)
    FA2 = "fa2"  # torch.nn.attention.varlen.varlen_attn: FlashAttention-2 (VARLEN)
    FA3 = "fa3"  # FlashAttention-3 from the `fa3-fwd` wheel, Hopper only (BATCHED dense, VARLEN)
    FA4 = "fa4"  # FlashAttention-4 (CuTe DSL) from the `flash-attn-4` wheel, Hopper and Blackwell (BATCHED, VARLEN)


CANDIDATES: dict[AttentionKind, tuple[Backend, ...]] = {
    AttentionKind.BATCHED: (Backend.CUDNN, Backend.FA3, Backend.FA4, Backend.SDPA),
    AttentionKind.VARLEN: (Backend.FA3, Backend.FA4, Backend.FA2),
    AttentionKind.LOOP: (Backend.SDPA,),
}
FALLBACK = {AttentionKind.BATCHED: Backend.SDPA, AttentionKind.VARLEN: Backend.FA2, AttentionKind.LOOP: Backend.SDPA}
# Segment lengths the plan is measured at (patches): a 256-patch minimum image, 448px (784), 640px
# (1,600), 1024px (4,096), 1080p (8,160), a 16-megapixel image's fraction (16,384).
LADDER = (256, 784, 1600, 4096, 8160, 16384)
MEASURE_ROWS = 32768  # patch rows per timed call: segments of a length x as many as fit
# gpu_ms's busy-wait before a repetition, in GPU clock cycles: ~1 ms at ~2 GHz to start, at most ~100 ms.
SLEEP_CYCLES, MAX_SLEEP_CYCLES = 2_000_000, 200_000_000


class Attn(NamedTuple):
    """How this step's attention runs, fixed for the whole step. Under torch.compile the layout and the kernel
    are guards (each pair compiles once), the integers symbolic, cu_seqlens a device input."""

    kind: AttentionKind
    backend: Backend
    cu_seqlens: torch.Tensor  # [B+1] int32 (VARLEN)
    max_seqlen: int  # VARLEN: upper bound on a segment's length; else 0
    batch: int  # BATCHED: number of (equal-length) segments; else 0
    seq_lens: tuple[int, ...] | None  # LOOP only (never under torch.compile)


@dataclass(frozen=True)
class AttentionPlan:
    """Which backend runs each layout, by segment length: `choose(kind, longest)` takes the row of the
    ladder length nearest the step's longest segment (on a log scale). A layout with no rows takes its
    FALLBACK. `ms` keeps what was measured (layout/length -> backend -> ms) for the log and /ready."""

    table: dict[AttentionKind, tuple[tuple[int, Backend], ...]] = field(default_factory=dict)
    ms: dict[str, dict[str, float]] = field(default_factory=dict)

    def choose(self, kind: AttentionKind, longest: int) -> Backend:
        rows = self.table.get(kind)
        if not rows:
            return FALLBACK[kind]
        return min(rows, key=lambda r: abs(math.log(r[0] / max(1, longest))))[1]

    def backends(self, kind: AttentionKind) -> set[Backend]:
        """Every backend this layout can be given (what start-up must compile)."""
        rows = self.table.get(kind)
        return {b for _, b in rows} if rows else {FALLBACK[kind]}

    def describe(self) -> str:
        """One line for the log: each layout's backend by length ('batched cudnn 256-784 fa3 1600-16384; varlen fa3')."""
        parts = []
        for kind in (AttentionKind.BATCHED, AttentionKind.VARLEN):
            rows = self.table.get(kind)
            if not rows:
                parts.append(f"{kind.value} {FALLBACK[kind].value}")
                continue
            runs: list[tuple[Backend, int, int]] = []  # (backend, first length, last length)
            for n, b in rows:
                if runs and runs[-1][0] == b:
                    runs[-1] = (b, runs[-1][1], n)
                else:
                    runs.append((b, n, n))
            if len(runs) == 1:
                parts.append(f"{kind.value} {runs[0][0].value}")
            else:
                parts.append(f"{kind.value} " + " ".join(f"{b.value} {lo}-{hi}" for b, lo, hi in runs))
        return "; ".join(parts)

    @classmethod
    def forced(cls, backend: Backend) -> AttentionPlan:
        """`backend` wherever it can run a layout, the fallback elsewhere (--attention NAME)."""
        return cls({k: tuple((n, backend) for n in LADDER) for k, c in CANDIDATES.items() if backend in c})


def plan_from_timings(ms: dict[tuple[AttentionKind, int], dict[Backend, float]]) -> AttentionPlan:
    """The plan that takes, for each layout and ladder length, the backend with the least time."""
    table: dict[AttentionKind, list[tuple[int, Backend]]] = {}
    for (kind, n), times in sorted(ms.items(), key=lambda kv: (kv[0][0].value, kv[0][1])):
        if times:
            table.setdefault(kind, []).append((n, min(times, key=times.__getitem__)))
    return AttentionPlan({k: tuple(v) for k, v in table.items()},
                         {f"{k.value}/{n}": {b.value: round(t, 4) for b, t in times.items()} for (k, n), times in ms.items()})


# ---- FlashAttention-3 and -4 (optional extras) -----------------------------------------------------------
_optional: dict[str, tuple[object | None, str]] = {}  # name -> (the op or None, "installed" or why not)


def _optional_op(name: str, load, hint: str):
    """The op `load()` returns, loaded once per process, or None with the reason kept for the status line.
    A wheel that is missing says how to install it (`hint`); one built for another torch or CUDA fails to
    load in many ways, and any of them leaves the backend out rather than stopping the engine."""
    if name not in _optional:
        try:
            _optional[name] = (load(), "installed")
        except ImportError as e:
            _optional[name] = (None, f"not installed ({e.name or e}): {hint}")
        except Exception as e:  # noqa: BLE001 - see above
            _optional[name] = (None, f"does not load: {type(e).__name__}: {e}")
    return _optional[name][0]


def _load_fa3():
    """The `fa3-fwd` wheel registers its forward as a torch custom op with a fake implementation, so
    torch.compile traces through it and CUDA graphs capture it. Its interface module imports a module
    `flash_attn_config` that the wheel ships as `fa3_fwd_config`: aliased here."""
    import fa3_fwd_config

    sys.modules.setdefault("flash_attn_config", fa3_fwd_config)
    import fa3_fwd_interface  # noqa: F401  (registers the op)

    return torch.ops.fa3_fwd._flash_attn_forward


def _load_fa4():
    """FA4's Python entry point is not a torch op: it compiles its CuTe DSL kernel on first use (seconds, per
    configuration, cached in the process) and launches it through TVM-FFI on torch's current stream. Wrapped
    here as a custom op with a fake implementation so torch.compile traces through it as one node and CUDA
    graphs capture its launch. cu_seqlens None: the dense [B, L, H, D] layout."""
    from flash_attn.cute.interface import _flash_attn_fwd

    @torch.library.custom_op("qve::fa4_fwd", mutates_args=())
    def fa4_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None,
                max_seqlen: int, scale: float) -> torch.Tensor:
        varlen = cu_seqlens is not None
        return _flash_attn_fwd(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                               max_seqlen_q=max_seqlen if varlen else None,
                               max_seqlen_k=max_seqlen if varlen else None, softmax_scale=scale)[0]

    @fa4_fwd.register_fake
    def _(q, k, v, cu_seqlens, max_seqlen, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    return torch.ops.qve.fa4_fwd


def fa3_op():
    """torch.ops.fa3_fwd._flash_attn_forward (FlashAttention-3's forward, Hopper only), or None."""
    return _optional_op("fa3", _load_fa3, "pip install '.[fa3]' on a Hopper GPU")


def fa4_op():
    """torch.ops.qve.fa4_fwd(q, k, v, cu_seqlens, max_seqlen, scale) (FlashAttention-4's), or None."""
    return _optional_op("fa4", _load_fa4, "pip install '.[fa4]' on a Hopper or Blackwell GPU")


def fa3_status() -> str:
    fa3_op()
    return _optional["fa3"][1]


def fa4_status() -> str:
    fa4_op()
    return _optional["fa4"][1]


def why_not(backend: Backend) -> str:
    """What an error or a skip adds when `backend` does not run: an optional kernel's install status."""
    if backend == Backend.FA3:
        return f": FA3 {fa3_status()}"
    if backend == Backend.FA4:
        return f": FA4 {fa4_status()}"
    return ""


def varlen_available() -> bool:
    return _varlen_attn is not None


def available(kind: AttentionKind, device: torch.device) -> tuple[Backend, ...]:
    """The backends of `kind` that can be tried on `device` (measure_plan then checks that they run)."""
    if device.type != "cuda":
        return (Backend.SDPA,) if kind != AttentionKind.VARLEN else ()
    out = []
    for b in CANDIDATES[kind]:
        if b == Backend.FA3 and (fa3_op() is None or torch.cuda.get_device_capability(device)[0] != 9):
            continue  # FA3's kernels are Hopper's (sm_90) only
        if b == Backend.FA4 and (fa4_op() is None or torch.cuda.get_device_capability(device)[0] not in (9, 10)):
            continue  # FA4's forward: Hopper (sm_90) and Blackwell (sm_100)
        if b == Backend.FA2 and _varlen_attn is None:
            continue
        out.append(b)
    return tuple(out)


# ---- the call -------------------------------------------------------------------------------------------
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: Attn, scale: float) -> torch.Tensor:
    """Bidirectional attention within each segment (an image, a video's group) of a packed batch.
    q, k, v: [N, H, D] (views with a contiguous last dimension) -> [N, H, D]."""
    n, h, d = q.shape
    if attn.kind == AttentionKind.VARLEN:
        cu, m = attn.cu_seqlens, attn.max_seqlen
        if attn.backend == Backend.FA3:
            return fa3_op()(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m,
                            softmax_scale=scale)[0]
        if attn.backend == Backend.FA4:
            return fa4_op()(q, k, v, cu, m, scale)
        return _varlen_attn(q, k, v, cu, cu, m, m, scale=scale)
    if attn.kind == AttentionKind.BATCHED:
        bsz = attn.batch
        if attn.backend == Backend.FA3:  # [B, L, H, D] views of the packed rows: no transposes
            q4, k4, v4 = (t.reshape(bsz, n // bsz, h, d) for t in (q, k, v))
            return fa3_op()(q4, k4, v4, softmax_scale=scale)[0].reshape(n, h, d)
        if attn.backend == Backend.FA4:
            q4, k4, v4 = (t.reshape(bsz, n // bsz, h, d) for t in (q, k, v))
            return fa4_op()(q4, k4, v4, None, 0, scale).reshape(n, h, d)
        qs, ks, vs = (t.reshape(bsz, n // bsz, h, d).transpose(1, 2) for t in (q, k, v))
        if attn.backend == Backend.CUDNN:
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(qs, ks, vs, None, False, scale=scale)[0]
        else:
            out = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        return out.transpose(1, 2).reshape(n, h, d)
    outs = []
    for qi, ki, vi in zip(q.split(attn.seq_lens), k.split(attn.seq_lens), v.split(attn.seq_lens)):
        # NOTE: 4-D ([1, H, n, D]), not 3-D: with 3-D inputs PyTorch's CPU SDPA takes its math path, which
        # materialises the n x n scores (a 16-megapixel image: 65,536 patches, 32 GiB for one block);
        # 4-D takes the flash kernel, whose memory grows with n (measured at 8,192 patches, 16 heads:
        # 9.5 GB and 96 s against 0.04 GB and 3.6 s). transformers' sdpa attention passes 4-D too.
        o = F.scaled_dot_product_attention(qi.transpose(0, 1)[None], ki.transpose(0, 1)[None],
                                           vi.transpose(0, 1)[None], scale=scale)[0]
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, dim=0)


# ---- the measurement ----------------------------------------------------------------------------------
def _step(kind: AttentionKind, backend: Backend, length: int, rows: int, num_heads: int, head_dim: int,
          device: torch.device, dtype: torch.dtype, seed: int = 0):
    """q, k, v and the Attn of a step of equal segments of `length` patches filling about `rows` rows."""
    count = max(1, rows // length)
    n = count * length
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(n, 3, num_heads, head_dim, device=device, dtype=dtype, generator=g)
    q, k, v = qkv.unbind(1)  # strided views, as the tower passes them
    cu = torch.arange(0, n + 1, length, dtype=torch.int32, device=device)
    attn = Attn(kind, backend, cu, length if kind == AttentionKind.VARLEN else 0,
                count if kind == AttentionKind.BATCHED else 0, None)
    return q, k, v, attn


def backend_agrees(kind: AttentionKind, backend: Backend, num_heads: int, head_dim: int, device: torch.device,
                   dtype: torch.dtype) -> bool:
    """Whether `backend` runs `kind` on `device` and agrees with float32 SDPA (relative L2 < 2e-2)."""
    q, k, v, attn = _step(kind, backend, 256, 512, num_heads, head_dim, device, dtype, seed=1)
    scale = head_dim**-0.5
    try:
        with torch.inference_mode():
            out = attend(q, k, v, attn, scale)
            ref = F.scaled_dot_product_attention(*(t.float().view(2, 256, num_heads, head_dim).transpose(1, 2)
                                                   for t in (q, k, v)), scale=scale)
            ref = ref.transpose(1, 2).reshape(512, num_heads, head_dim)
        torch.cuda.synchronize(device)
    except (RuntimeError, TypeError, ValueError) as e:  # unsupported by this build / device / shape
        log.info("attention backend %s/%s does not run here: %s", kind.value, backend.value, e)
        return False
    err = ((out.float() - ref).norm() / ref.norm()).item()
    if not err < 2e-2:
        log.warning("attention backend %s/%s left out: relative error %.3g against float32", kind.value,
                    backend.value, err)
    return err < 2e-2


def gpu_ms(fn, calls: int = 8, reps: int = 3) -> float:
    """Device milliseconds per call of `fn`, its launches queued ahead of the device: the median over `reps`
    of `calls` back-to-back calls between two events, all queued behind a busy-wait kernel.

    Why not one call between two events on an idle device: that times the host's launch as well, and the
    kernels differ there (on an H100: FA4's Python entry point 0.09-0.18 ms of host time a call, FA3's 0.06,
    cuDNN's 0.03). In the service the host is ahead of the device: small steps replay graphs without any
    Python, and a large compiled step queues its blocks while the device runs the first ones. Timed one call
    at a time, FA3 led FA4 by 5-21% at 784 and 4,096 patches, yet the whole tower forced to FA4 ran 1-2%
    faster than forced to FA3; queued, FA4 leads from 1,600 patches up.

    The busy-wait starts short and is checked, not guessed: a repetition whose start event had already fired
    once its calls were queued (the device caught up with the host) is dropped and run again behind a wait
    four times as long. A fixed ~10 ms wait before each repetition was a third of the start-up plan's time
    (2.10 s against 1.35 with the checked wait on an H100, the same choices)."""
    per = []
    cycles = SLEEP_CYCLES
    with torch.inference_mode():
        fn()  # warm-up (and a JIT compile where a kernel has one)
        while len(per) < reps:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(cycles)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            caught_up = start.query()  # (read before the wait below: it says whether the host stayed ahead)
            end.synchronize()
            if caught_up and cycles < MAX_SLEEP_CYCLES:
                cycles = min(4 * cycles, MAX_SLEEP_CYCLES)
                continue
            per.append(start.elapsed_time(end) / calls)
    return statistics.median(per)


def measure_plan(device: torch.device, dtype: torch.dtype, num_heads: int, head_dim: int,
                 lengths: tuple[int, ...] = LADDER, rows: int = MEASURE_ROWS, reps: int = 3) -> AttentionPlan:
    """Time every backend that runs (and agrees) at each ladder length on the device (gpu_ms); the plan takes
    the fastest."""
    scale = head_dim**-0.5
    ms: dict[tuple[AttentionKind, int], dict[Backend, float]] = {}
    for kind in (AttentionKind.BATCHED, AttentionKind.VARLEN):
        working = [b for b in available(kind, device) if backend_agrees(kind, b, num_heads, head_dim, device, dtype)]
        for length in lengths:
            ms[(kind, length)] = {}
            for backend in working:
                q, k, v, attn = _step(kind, backend, length, max(rows, length), num_heads, head_dim, device, dtype)
                ms[(kind, length)][backend] = gpu_ms(lambda: attend(q, k, v, attn, scale), reps=reps)
                del q, k, v
    return plan_from_timings(ms)


def plan_for(choice: str, device: torch.device, dtype: torch.dtype, num_heads: int, head_dim: int) -> AttentionPlan:
    """The engine's plan for --attention `choice`: "auto" measures one; a backend's name forces it
    (an error if it cannot run here: asked for by name, it must not silently be something else)."""
    if choice == "auto":
        return measure_plan(device, dtype, num_heads, head_dim)
    backend = Backend(choice)
    kinds = [k for k in (AttentionKind.BATCHED, AttentionKind.VARLEN) if backend in CANDIDATES[k]]
    for kind in kinds:
        if backend not in available(kind, device) or not backend_agrees(kind, backend, num_heads, head_dim, device, dtype):
            raise RuntimeError(f"--attention {choice} does not run on {device} "
                               f"({torch.cuda.get_device_name(device)}){why_not(backend)}; use --attention auto")
    return AttentionPlan.forced(backend)
