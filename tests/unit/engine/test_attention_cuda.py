"""Every attention kernel on a CUDA GPU (skipped without one) against float32 attention: each layout
with each kernel that runs here, for 1..16 equal images, mixed sizes, a video-sized step and 1080p
segments; and the start-up measurement (a plan whose every choice is the fastest it timed). FA3 runs
where the `fa3` extra is installed on a Hopper GPU, FA4 where the `fa4` extra is, on a Hopper or Blackwell
GPU; otherwise their cases are skipped, saying why. FA4's op also under torch.compile and in a CUDA graph,
as the service runs it."""

import pytest
import torch
import torch.nn.functional as F

from service.engine.attention import (CANDIDATES, LADDER, AttentionKind, Attn, Backend, attend, available,
                                      _step, backend_agrees, gpu_ms, measure_plan, why_not)

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
        out += [(name, kind, backend) for kind in kinds for backend in CANDIDATES[kind]]
    return out


@pytest.mark.parametrize("name,kind,backend", _cases(), ids=lambda x: getattr(x, "value", x))
def test_every_kernel_equals_float32_attention(name, kind, backend):
    device = torch.device("cuda")
    if backend not in available(kind, device):
        pytest.skip(f"{backend.value} does not run {kind.value} here" + why_not(backend))
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


def test_gpu_ms_behind_its_checked_wait_equals_a_long_fixed_wait():
    """gpu_ms starts with a ~1 ms busy-wait and lengthens it only when the device caught up with the host:
    what it gives equals the time behind a ~50 ms wait, which no queueing of 8 calls outlasts."""
    device = torch.device("cuda")
    q, k, v, attn = _step(AttentionKind.BATCHED, Backend.SDPA, 784, 64 * 784, HEADS, DIM, device, torch.bfloat16)
    run = lambda: attend(q, k, v, attn, DIM**-0.5)  # noqa: E731
    fixed = []
    with torch.inference_mode():
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(100_000_000)
            start.record()
            for _ in range(8):
                run()
            end.record()
            end.synchronize()
            fixed.append(start.elapsed_time(end) / 8)
    checked = [gpu_ms(run) for _ in range(5)]
    print(f"gpu_ms {sorted(checked)} against a fixed wait {sorted(fixed)}")
    assert abs(sorted(checked)[2] / sorted(fixed)[2] - 1) < 0.1


@pytest.mark.parametrize("kind", [AttentionKind.VARLEN, AttentionKind.BATCHED], ids=lambda k: k.value)
def test_fa4_compiled_and_replayed_from_a_cuda_graph_equals_its_eager_call(kind):
    """The service compiles the tower and replays small steps from CUDA graphs: FA4's custom op must trace
    as one node and its launch must be captured (on the capturing stream), giving the eager call's bits."""
    device = torch.device("cuda")
    if Backend.FA4 not in available(kind, device):
        pytest.skip(f"fa4 does not run {kind.value} here" + why_not(Backend.FA4))
    lens = (784,) * 4
    n = sum(lens)
    g = torch.Generator(device=device).manual_seed(11)
    qkv = torch.randn(n, 3, HEADS, DIM, device=device, dtype=torch.bfloat16, generator=g)
    cu = torch.tensor([0, 784, 1568, 2352, 3136], dtype=torch.int32, device=device)
    attn = Attn(kind, Backend.FA4, cu, 784 if kind == AttentionKind.VARLEN else 0,
                4 if kind == AttentionKind.BATCHED else 0, None)
    step = lambda x: attend(*x.unbind(1), attn, DIM**-0.5) * 2  # noqa: E731  (something for compile to fuse)
    with torch.inference_mode():
        eager = step(qkv)
        compiled = torch.compile(step, fullgraph=True)(qkv)
        static = qkv.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(static)  # warm-up outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                captured = step(static)
        torch.cuda.current_stream().wait_stream(stream)
        static.copy_(torch.randn(n, 3, HEADS, DIM, device=device, dtype=torch.bfloat16, generator=g))
        graph.replay()
        replayed_ref = step(static)
    torch.cuda.synchronize()
    assert torch.equal(compiled, eager)
    assert torch.equal(captured, replayed_ref)  # the replay read the new inputs, as the eager call did
    assert not torch.equal(captured, eager)
