"""Every attention kernel on a CUDA GPU (skipped without one) against float32 attention: each layout
with each kernel that runs here, for 1..16 equal images, mixed sizes, a video-sized step and 1080p
segments; and the start-up measurement (a plan whose every choice is the fastest it timed). FA3 runs
where the `fa3` extra is installed on a Hopper GPU; otherwise its cases are skipped, saying why."""

import pytest
import torch
import torch.nn.functional as F

from service.engine.attention import (LADDER, AttentionKind, Attn, Backend, attend, available, backend_agrees,
                                      fa3_status, measure_plan)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HEADS, DIM = 16, 64  # the 2B/4B/8B presets' heads
STEPS = {  # name -> segment lengths (patches)
    **{f"{k} x 448px": (784,) * k for k in (1, 2, 4, 8, 16)},
    "mixed photos": (1200, 784, 256, 1728, 3456, 544),
    "video, 12 groups of 720p": (3600,) * 12,
    "2 x 1080p": (8160, 8160),
}
TOL = 1e-2  # relative L2 against float32; bf16 kernels measured 3e-3..5e-3


def _reference(q, k, v, lens):
    outs, at = [], 0
    for n in lens:
        qi, ki, vi = (t[at : at + n].float().transpose(0, 1)[None] for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qi, ki, vi)[0].transpose(0, 1))
        at += n
    return torch.cat(outs)


def _cases():
    out = []
    for name, lens in STEPS.items():
        kinds = [AttentionKind.VARLEN] + ([AttentionKind.BATCHED] if len(set(lens)) == 1 else [])
        out += [(name, kind, backend) for kind in kinds for backend in Backend
                if backend in {AttentionKind.VARLEN: (Backend.FA3, Backend.FA2),
                               AttentionKind.BATCHED: (Backend.CUDNN, Backend.FA3, Backend.SDPA)}[kind]]
    return out


@pytest.mark.parametrize("name,kind,backend", _cases(), ids=lambda x: getattr(x, "value", x))
def test_every_kernel_equals_float32_attention(name, kind, backend):
    device = torch.device("cuda")
    if backend not in available(kind, device):
        pytest.skip(f"{backend.value} does not run {kind.value} here" + (f": FA3 {fa3_status()}" if backend == Backend.FA3 else ""))
    lens = STEPS[name]
    n = sum(lens)
    g = torch.Generator(device=device).manual_seed(len(lens))
    qkv = torch.randn(n, 3, HEADS, DIM, device=device, dtype=torch.bfloat16, generator=g)
    q, k, v = qkv.unbind(1)  # strided views, as the tower passes them
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    attn = Attn(kind, backend, cu, max(lens) if kind == AttentionKind.VARLEN else 0,
                len(lens) if kind == AttentionKind.BATCHED else 0, None)
    with torch.inference_mode():
        out = attend(q, k, v, attn, DIM**-0.5)
        ref = _reference(q, k, v, lens)
    assert out.shape == (n, HEADS, DIM) and out.dtype == torch.bfloat16
    err = ((out.float() - ref).norm() / ref.norm()).item()
    print(f"{name:26s} {kind.value:7s} {backend.value:5s} rel err {err:.2e}")
    assert err < TOL


def test_the_measured_plan_takes_the_fastest_kernel_it_timed_at_every_length():
    device = torch.device("cuda")
    plan = measure_plan(device, torch.bfloat16, HEADS, DIM, reps=3)
    for kind in (AttentionKind.BATCHED, AttentionKind.VARLEN):
        working = [b for b in available(kind, device) if backend_agrees(kind, b, HEADS, DIM, device, torch.bfloat16)]
        assert working, kind  # cuDNN or SDPA batched, FA2 varlen: something always runs on a GPU
        for n in LADDER:
            times = plan.ms[f"{kind.value}/{n}"]
            assert set(times) == {b.value for b in working}, (kind, n)
            assert all(t > 0 for t in times.values())
            assert plan.choose(kind, n).value == min(times, key=times.get), (kind, n, times)
    print("plan:", plan.describe())
    print({k: v for k, v in plan.ms.items()})
