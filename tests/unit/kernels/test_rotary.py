"""The fused Triton rotary (kernels/qve_kernels/rotary.py) against the tower's plain-torch rotary: eagerly, under
torch.compile with dynamic shapes, and bad inputs. CUDA-only (skipped without a GPU and Triton)."""

import pytest
import torch

from qve_kernels import rotary
from service.engine.tower import _rotary

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and rotary.available()), reason="needs CUDA and Triton")


def _inputs(n: int, heads: int, head_dim: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # Columns 0..H*D-1 are q, then k, then v; a wider row stride than 3*H*D is not used by the tower.
    qkv = (torch.randn(n, 3 * heads * head_dim, device="cuda", generator=g) * 2).to(torch.bfloat16)
    half = torch.rand(n, head_dim // 2, device="cuda", generator=g) * 60  # angles of real grids (tens of radians)
    cos = torch.cat([half, half], -1).cos().contiguous()
    s = half.sin()
    sin = torch.cat([-s, s], -1).contiguous()
    return qkv, cos, sin


def _reference(qkv, cos, sin, heads, head_dim):
    return _rotary(qkv.view(qkv.shape[0], 3, heads, head_dim)[:, :2], cos, sin)


def test_supports_needs_triton_and_power_of_two_layouts():
    assert rotary.supports(16, 64) == rotary.available()
    assert not rotary.supports(12, 64)  # 24 head vectors: not a power of two
    assert not rotary.supports(16, 48)


@needs_gpu
@pytest.mark.parametrize("n,heads,head_dim", [(784, 16, 64), (50176, 16, 64), (4096, 2, 32), (1, 16, 64)])
def test_kernel_equals_the_torch_rotary(n, heads, head_dim):
    qkv, cos, sin = _inputs(n, heads, head_dim)
    out = rotary.rotary_qk(qkv, cos, sin, heads)
    ref = _reference(qkv, cos, sin, heads, head_dim)
    assert out.shape == (n, 2, heads, head_dim) and out.dtype == torch.bfloat16 and out.is_contiguous()
    diff = (out.float() - ref.float()).abs()
    # Same float32 formula; at most a fused multiply-add's last-bit difference before the bf16 rounding,
    # so an element may differ by one bf16 step, and rarely.
    assert (diff <= ref.float().abs() * 2**-7 + 1e-6).all()
    assert (diff > 0).float().mean().item() < 0.01


@needs_gpu
def test_kernel_under_torch_compile_with_dynamic_shapes():
    fn = torch.compile(lambda qkv, cos, sin: rotary.rotary_qk(qkv, cos, sin, 16), dynamic=True, fullgraph=True)
    for n in (256, 832, 6400):
        qkv, cos, sin = _inputs(n, 16, 64, seed=n)
        assert torch.equal(fn(qkv, cos, sin), rotary.rotary_qk(qkv, cos, sin, 16))


@needs_gpu
def test_bad_inputs_are_refused_with_a_message():
    qkv, cos, sin = _inputs(64, 16, 64)
    with pytest.raises(ValueError, match="qkv"):
        rotary.rotary_qk(qkv.float(), cos, sin, 16)
    with pytest.raises(ValueError, match="columns"):
        rotary.rotary_qk(qkv, cos, sin, 8)
    with pytest.raises(ValueError, match="cos"):
        rotary.rotary_qk(qkv, cos[:32], sin, 16)
    with pytest.raises(ValueError, match="sin"):
        rotary.rotary_qk(qkv, cos, sin.double(), 16)
