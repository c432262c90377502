"""The attention module on the CPU: the per-segment loop's memory and values, and the plan (which
kernel each step takes) from timings. The kernels themselves, the measurement and FA3: test_attention_cuda.py."""

import pytest
import torch

from service.engine.attention import (FALLBACK, LADDER, AttentionKind, AttentionPlan, Attn, Backend, attend, available,
                                      MAX_SLEEP_CYCLES, SLEEP_CYCLES, fa3_op, fa3_status, fa4_op, fa4_status, gpu_ms,
                                      plan_from_timings, why_not)

B, V = AttentionKind.BATCHED, AttentionKind.VARLEN


def test_cpu_attention_of_a_large_image_does_not_materialise_the_scores():
    """Issue 23: on the CPU a 16-megapixel image (65,536 patches) made a step allocate 32 GiB, the n x n
    scores of one block, and failed with a 500. The per-image attention must grow with n, not n**2: here
    16,384 patches of 2 heads, whose scores alone would be 2 GiB, in a process of its own (peak RSS)."""
    import subprocess
    import sys

    code = """
import resource, torch
from service.engine.attention import AttentionKind, Attn, Backend, attend
n, h, d = 16384, 2, 32
q, k, v = (torch.randn(n, h, d) for _ in range(3))
attn = Attn(AttentionKind.LOOP, Backend.SDPA, torch.tensor([0, n], dtype=torch.int32), 0, 0, (n,))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = attend(q, k, v, attn, d ** -0.5)
assert out.shape == (n, h, d)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    grown = int(done.stdout.strip())
    assert grown < 256 * 1024**2, f"attention of 16,384 patches grew the process by {grown / 1024**2:.0f} MiB"


def test_cpu_attention_per_image_equals_the_plain_softmax_of_each_image():
    torch.manual_seed(3)
    lens = (64, 40, 100)
    n, h, d = sum(lens), 4, 16
    q, k, v = (torch.randn(n, h, d, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 64, 104, 204], dtype=torch.int32)
    out = attend(q, k, v, Attn(AttentionKind.LOOP, Backend.SDPA, cu, 0, 0, lens), d ** -0.5)
    parts = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):  # each image attends only to itself
        scores = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * d ** -0.5
        parts.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[a:b]))
    assert torch.allclose(out, torch.cat(parts), atol=1e-10, rtol=0)


def _timings():
    """Timings shaped like issue 24's H200 probes: cuDNN wins short equal steps, FA3 long ones, and FA3
    every varlen length."""
    ms = {}
    for n in LADDER:
        ms[(B, n)] = {Backend.CUDNN: 1.0 if n <= 784 else 2.0, Backend.FA3: 1.5 if n <= 784 else 1.2, Backend.SDPA: 3.0}
        ms[(V, n)] = {Backend.FA3: 1.0, Backend.FA2: 1.4}
    return ms


def test_the_plan_takes_the_fastest_kernel_at_each_length_and_a_step_the_row_nearest_its_longest_segment():
    plan = plan_from_timings(_timings())
    assert plan.table[B] == ((256, Backend.CUDNN), (784, Backend.CUDNN), (1600, Backend.FA3), (4096, Backend.FA3),
                             (8160, Backend.FA3), (16384, Backend.FA3))
    assert plan.choose(B, 784) == Backend.CUDNN and plan.choose(B, 4096) == Backend.FA3
    # nearest on a log scale: 1,100 is nearer 784 (x1.40) than 1,600 (x1.45); 1,200 nearer 1,600
    assert plan.choose(B, 1100) == Backend.CUDNN and plan.choose(B, 1200) == Backend.FA3
    assert plan.choose(B, 1) == Backend.CUDNN and plan.choose(B, 10**6) == Backend.FA3  # beyond the ladder's ends
    assert plan.choose(V, 300) == Backend.FA3
    assert plan.backends(B) == {Backend.CUDNN, Backend.FA3} and plan.backends(V) == {Backend.FA3}
    assert plan.describe() == "batched cudnn 256-784 fa3 1600-16384; varlen fa3"
    assert plan.ms["batched/784"] == {"cudnn": 1.0, "fa3": 1.5, "sdpa": 3.0}


def test_a_layout_with_nothing_measured_takes_its_fallback():
    ms = _timings()
    for n in LADDER:
        ms[(V, n)] = {}  # no varlen kernel ran (e.g. no varlen_attn and no FA3)
    plan = plan_from_timings(ms)
    assert V not in plan.table and plan.choose(V, 784) == FALLBACK[V] == Backend.FA2
    empty = AttentionPlan()
    assert [empty.choose(k, 784) for k in (B, V, AttentionKind.LOOP)] == [Backend.SDPA, Backend.FA2, Backend.SDPA]
    assert empty.describe() == "batched sdpa; varlen fa2"


def test_a_forced_kernel_runs_every_layout_it_can_and_the_others_keep_their_fallback():
    fa3 = AttentionPlan.forced(Backend.FA3)
    assert fa3.choose(B, 256) == fa3.choose(B, 8160) == fa3.choose(V, 784) == Backend.FA3
    cudnn = AttentionPlan.forced(Backend.CUDNN)
    assert cudnn.choose(B, 784) == Backend.CUDNN and cudnn.choose(V, 784) == Backend.FA2
    assert cudnn.describe() == "batched cudnn; varlen fa2"
    fa2 = AttentionPlan.forced(Backend.FA2)
    assert fa2.choose(B, 784) == Backend.SDPA and fa2.choose(V, 784) == Backend.FA2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's answers")
def test_on_the_cpu_only_the_per_segment_loop_and_batched_sdpa_are_available_and_fa3_fa4_say_why_not():
    cpu = torch.device("cpu")
    assert available(B, cpu) == (Backend.SDPA,) and available(V, cpu) == ()
    if fa3_op() is None:  # the fa3 extra is not installed here (CI): the reason names the wheel
        assert "not installed" in fa3_status() and "fa3" in fa3_status()
    if fa4_op() is None:  # likewise the fa4 extra
        assert "not installed" in fa4_status() and "fa4" in fa4_status()
    assert why_not(Backend.FA3) == f": FA3 {fa3_status()}" and why_not(Backend.FA4) == f": FA4 {fa4_status()}"
    assert why_not(Backend.CUDNN) == why_not(Backend.FA2) == ""


def test_batched_sdpa_equals_each_segment_attended_alone():
    torch.manual_seed(5)
    n, h, d = 3 * 50, 2, 8
    q, k, v = (torch.randn(n, h, d, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 50, 100, 150], dtype=torch.int32)
    batched = attend(q, k, v, Attn(B, Backend.SDPA, cu, 0, 3, None), d**-0.5)
    loop = attend(q, k, v, Attn(AttentionKind.LOOP, Backend.SDPA, cu, 0, 0, (50, 50, 50)), d**-0.5)
    assert torch.allclose(batched, loop, atol=1e-12, rtol=0)


class _Device:
    """A simulated device for gpu_ms: the host needs `launch_cycles` of the device's clock to queue a
    repetition's calls, each call runs 1 ms, and a call the host had not queued when the device reached it
    starts late (the host's launch is then in the time)."""

    def __init__(self, launch_cycles: int):
        self.launch_cycles, self.sleeps = launch_cycles, []

    def sleep(self, cycles: int) -> None:
        self.sleeps.append(cycles)

    def event(self, enable_timing: bool):
        device = self

        class Event:
            def record(self):
                self.sleep = device.sleeps[-1]

            def query(self):  # the start event has fired iff the device's wait ended before the host was done
                return self.sleep <= device.launch_cycles

            def synchronize(self):
                pass

            def elapsed_time(self, end):  # 8 calls: 8 ms, plus the launch time the device waited for
                return 8.0 + (0.5 if self.query() else 0.0)

        return Event()


@pytest.mark.parametrize("launch_cycles,sleeps", [
    (1_000_000, [SLEEP_CYCLES] * 3),  # the host well ahead: the first wait is enough
    (20_000_000, [SLEEP_CYCLES, 4 * SLEEP_CYCLES] + [16 * SLEEP_CYCLES] * 3),  # two dropped
])
def test_gpu_ms_drops_a_repetition_that_the_device_caught_up_with_and_waits_longer(monkeypatch, launch_cycles, sleeps):
    device, calls = _Device(launch_cycles), []
    monkeypatch.setattr(torch.cuda, "_sleep", device.sleep)
    monkeypatch.setattr(torch.cuda, "Event", device.event)
    assert gpu_ms(lambda: calls.append(1), calls=8, reps=3) == 1.0  # no host time in it
    assert device.sleeps == sleeps
    assert len(calls) == 1 + 8 * len(sleeps)  # the warm-up, then every repetition run, dropped ones included


def test_gpu_ms_keeps_what_it_measured_once_the_wait_is_at_its_longest(monkeypatch):
    device = _Device(launch_cycles=10**12)  # a host slower than any wait: the measurement ends anyway
    monkeypatch.setattr(torch.cuda, "_sleep", device.sleep)
    monkeypatch.setattr(torch.cuda, "Event", device.event)
    assert gpu_ms(lambda: None, reps=3) == 8.5 / 8
    assert device.sleeps[-3:] == [MAX_SLEEP_CYCLES] * 3 and device.sleeps[:2] == [SLEEP_CYCLES, 4 * SLEEP_CYCLES]


def _fake_fa4_package(monkeypatch, calls: list, fwd=None):
    """Stand-in modules for FA4's package: `flash_attn.cute.interface._flash_attn_fwd` computes attention
    with SDPA per segment (what FA4's kernel computes) and records how it was called."""
    import sys
    import types

    import torch.nn.functional as F

    def _flash_attn_fwd(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                        softmax_scale=None):
        calls.append({"shape": tuple(q.shape), "cu": None if cu_seqlens_q is None else cu_seqlens_q.tolist(),
                      "same_cu": cu_seqlens_q is cu_seqlens_k, "max": (max_seqlen_q, max_seqlen_k),
                      "scale": softmax_scale})
        if cu_seqlens_q is None:  # dense [B, L, H, D]
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=softmax_scale)
            return out.transpose(1, 2), None
        bounds = cu_seqlens_q.tolist()
        outs = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)),
                                               scale=softmax_scale)[0].transpose(0, 1)
                for a, b in zip(bounds, bounds[1:])]
        return torch.cat(outs), None

    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd = fwd or _flash_attn_fwd
    for name, mod in (("flash_attn", types.ModuleType("flash_attn")), ("flash_attn.cute", types.ModuleType("flash_attn.cute")),
                      ("flash_attn.cute.interface", interface)):
        monkeypatch.setitem(sys.modules, name, mod)


def test_the_fa4_op_passes_each_layout_to_fa4_as_its_interface_expects_and_traces_as_one_op(monkeypatch):
    """FA4 runs only on Hopper and Blackwell GPUs; what the service adds around it, the custom op that maps
    a step's layout onto FA4's arguments and its fake implementation (what torch.compile traces), is
    checked here against a stand-in for FA4's package, and against the per-segment loop's values."""
    import importlib.util

    from service.engine import attention

    if importlib.util.find_spec("flash_attn") is not None:  # its op's name would be taken by the stand-in's
        pytest.skip("a flash_attn package is installed here: test_attention_cuda.py runs the real FA4")
    monkeypatch.setattr(attention, "_optional", {})  # loaded afresh, with the stand-in
    calls: list = []
    _fake_fa4_package(monkeypatch, calls)
    op = fa4_op()
    assert op is torch.ops.qve.fa4_fwd and fa4_status() == "installed" and why_not(Backend.FA4) == ": FA4 installed"
    assert fa4_op() is op  # loaded once

    torch.manual_seed(9)
    h, d, scale = 2, 8, 8**-0.5
    lens = (30, 50, 20)
    n = sum(lens)
    q, k, v = (torch.randn(n, h, d, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 30, 80, 100], dtype=torch.int32)
    loop = attend(q, k, v, Attn(AttentionKind.LOOP, Backend.SDPA, cu, 0, 0, lens), scale)
    varlen = attend(q, k, v, Attn(V, Backend.FA4, cu, 50, 0, None), scale)
    assert torch.allclose(varlen, loop, atol=1e-12, rtol=0)
    assert calls[-1] == {"shape": (n, h, d), "cu": [0, 30, 80, 100], "same_cu": True, "max": (50, 50), "scale": scale}

    equal = torch.tensor([0, 25, 50, 75, 100], dtype=torch.int32)
    batched = attend(q, k, v, Attn(B, Backend.FA4, equal, 0, 4, None), scale)
    assert calls[-1] == {"shape": (4, 25, h, d), "cu": None, "same_cu": True, "max": (None, None), "scale": scale}
    assert torch.allclose(batched, attend(q, k, v, Attn(AttentionKind.LOOP, Backend.SDPA, equal, 0, 0, (25,) * 4), scale),
                          atol=1e-12, rtol=0)

    # The fake implementation agrees with the real call (shape, dtype, strides), for both layouts: what
    # torch.compile and CUDA graph capture rely on.
    torch.library.opcheck(op, (q, k, v, cu, 50, scale), test_utils=("test_schema", "test_faketensor"))
    q4, k4, v4 = (t.reshape(4, 25, h, d) for t in (q, k, v))
    torch.library.opcheck(op, (q4, k4, v4, None, 0, scale), test_utils=("test_schema", "test_faketensor"))


def test_an_fa4_package_that_fails_to_load_is_left_out_with_the_reason(monkeypatch, tmp_path):
    """A wheel built for another torch or CUDA fails at import in ways other than ImportError (its native
    libraries): the backend is left out, the status line says what failed, and nothing is raised."""
    import sys

    from service.engine import attention

    package = tmp_path / "flash_attn" / "cute"
    package.mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "interface.py").write_text('raise OSError("libcute_dsl_runtime.so: cannot open shared object file")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface"):
        # absent again after the test, whatever the import leaves (a real FA4 put back where there is one)
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name))
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(attention, "_optional", {})
    assert fa4_op() is None
    assert fa4_status() == "does not load: OSError: libcute_dsl_runtime.so: cannot open shared object file"
    assert why_not(Backend.FA4) == f": FA4 {fa4_status()}"
    assert Backend.FA4 not in available(V, torch.device("cpu"))
