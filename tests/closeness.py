"""Equality up to fp32 rounding, for tests that compute one thing two ways (padded wider, packed against per-block, a
hand-written loss, one process against several). An element-wise ``atol`` alone is host-dependent there: a reordered
sum (another pad width, another SIMD kernel: AVX2 against AVX-512) moves an element near zero by about the tensor's
magnitude times a few fp32 epsilons, so the absolute bound is scaled to each tensor's largest element."""

from __future__ import annotations

import torch

# fp32's epsilon is 1.2e-7; a reduction over a few hundred terms reorders to ~1e-6 of the scale: 1e-5 leaves 10x margin,
# and a real difference (a padded position read, a term dropped) moves elements by far more.
SCALE_RTOL = 1e-5


def assert_close_to_scale(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-4, scale_rtol: float = SCALE_RTOL,
                          what: str = "") -> None:
    """``got`` equals ``want`` element-wise within ``rtol``, or within ``scale_rtol`` of the larger tensor's largest
    element."""
    scale = max(got.abs().max().item(), want.abs().max().item()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=scale_rtol * scale,
                               msg=lambda m: f"{what}: {m} (scale {scale:.3g})" if what else m)


def assert_same_gradients(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], **kwargs) -> None:
    """Each parameter's gradient in ``got`` equals ``want``'s up to rounding (:func:`assert_close_to_scale`)."""
    assert got.keys() == want.keys()
    for name in want:
        assert_close_to_scale(got[name], want[name], what=name, **kwargs)
