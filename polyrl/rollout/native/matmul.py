"""The weight matmuls of the native engine, with CPU weights prepacked for oneDNN where it helps.

On a CPU, `F.linear` hands every call to BLAS, which re-lays the weight out into its blocked
format on each call; for the engine's decode shapes (64 rows x a few hundred to a few thousand
columns) that re-layout is most of the cost. oneDNN can do it once: `mkldnn._reorder_linear_weight`
returns the weight in oneDNN's blocked layout (an opaque tensor) and `mkldnn._linear_pointwise`
multiplies by it, the same pair inductor's CPU freezing pass uses. Measured on the bench machine
(docs/benchmarks.md, Rollout engine): one decode step's projections at 64 rows run 2.4-2.6x faster
than `F.linear` in fp32, and the whole engine 1.5-1.8x faster. In bf16 the matmuls gain only
1.2-1.4x, the fused residual add costs part of that back, and the engine measured 0.92-1.06x, so
bf16 keeps `F.linear` (BLAS already uses the bf16 matrix instructions directly). The packed product
sums in a different order from BLAS, so results differ in the last bits (~1e-6 relative), not more.

Packing applies to float32 CPU tensors when this torch build has the ops and they give the plain
product on a probe; everything else (CUDA, bf16 / fp16, builds without oneDNN) uses `F.linear` on
the plain weights. The packed copy is extra memory (one more copy of the matrices).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

PACKED_DTYPES = (torch.float32,)  # where packing measured clearly faster (see above)


class PlainMatmul:
    """`F.linear` on the plain weights: the fallback everywhere packing does not apply."""

    packs = False

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, w, b)

    def residual_linear(self, x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
        """x + a @ w^T in one BLAS call (beta=1 accumulates into a copy of x)."""
        if b is not None or a.dim() != 2:
            return x + F.linear(a, w, b)
        return torch.addmm(x, a, w.t())


class OneDNNPackedMatmul:
    """Weights reordered once into oneDNN's blocked layout; products through `_linear_pointwise`."""

    packs = True

    def __init__(self, batch_hint: int):
        self.batch_hint = batch_hint  # the row count the layout is chosen for (decode batch)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), self.batch_hint)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")

    def residual_linear(self, x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
        """x + a @ w^T + b with the add fused into the product (x itself is not written)."""
        if a.dim() != 2:
            return x + self.linear(a, w, b)
        return torch.ops.mkldnn._linear_pointwise(a, x.contiguous(), w, b, "add")


@functools.cache
def _onednn_works(dtype: torch.dtype) -> bool:
    """Whether packing exists in this build and reproduces `F.linear` on a small CPU probe."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w, x, r = (torch.randn(*s, generator=gen).to(dtype) for s in ((24, 16), (5, 16), (5, 24)))
        mm = OneDNNPackedMatmul(batch_hint=5)
        packed = mm.pack(w)
        tol = 1e-4
        return bool(
            torch.allclose(mm.linear(x, packed, None).float(), F.linear(x, w).float(), atol=tol, rtol=tol)
            and torch.allclose(mm.residual_linear(r, x, packed, None).float(), (r + F.linear(x, w)).float(),
                               atol=tol, rtol=tol)
        )
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def matmul_for(like: torch.Tensor, batch_hint: int) -> PlainMatmul | OneDNNPackedMatmul:
    """The matmul implementation for weights like `like` (its device and dtype decide)."""
    if like.is_cpu and _onednn_works(like.dtype):
        return OneDNNPackedMatmul(batch_hint)
    return PlainMatmul()
