"""The weight matmuls of the native engine, with CPU weights prepacked for oneDNN where it helps.

On a CPU, `F.linear` hands every call to BLAS, which re-lays the weight out into its blocked
format on each call; for the engine's decode shapes (64 rows x a few hundred to a few thousand
columns) that re-layout is most of the cost. oneDNN can do it once: `mkldnn._reorder_linear_weight`
returns the weight in oneDNN's blocked layout (an opaque tensor) and `mkldnn._linear_pointwise`
multiplies by it, the same pair inductor's CPU freezing pass uses. Measured on the bench machine
(docs/benchmarks.md, Rollout engine): one decode step's projections at 64 rows run 2.4-2.6x faster
than `F.linear` in fp32, and the whole engine 1.5-1.8x faster. Not everywhere: on an AVX2-only
CPU, BLAS's own kernels are good and oneDNN's larger per-call cost made small matrices (under ~1M
elements) 5-50% *slower* packed, while large ones still gained 1.1-1.6x. So each weight shape is
packed only where a timing at load (`packing_pays`, once per process and shape) shows the packed
product faster; the rest stay plain. In bf16 the matmuls gain only
1.2-1.4x, the fused residual add costs part of that back, and the engine measured 0.92-1.06x, so
bf16 keeps `F.linear` (BLAS already uses the bf16 matrix instructions directly). The packed product
sums in a different order from BLAS, so results differ in the last bits (~1e-6 relative), not more.

bf16 and fp16 on an x86 CPU *without* their matrix instructions (no avx512_bf16 / amx_bf16, resp.
no avx512_fp16 / amx_fp16: AVX2-only machines, for one) are another matter: BLAS and oneDNN
emulate those products by converting operands inside the kernel, 5-7x slower than fp32. There the
weights are packed as fp32 and each product runs in fp32 on activations widened from bf16 / fp16,
rounded back to the model's dtype (`WidenedMatmul`). That is the product the native instructions
compute (bf16 x bf16 products are exact in fp32, sums accumulate in fp32, one rounding at the
end); results differ from the emulated kernel only by the summation order, at most one unit in
the last place of bf16 / fp16. The packed fp32 copy costs twice the matrices' bf16 size in memory
(and a repack after an update briefly holds two of them).

Packing applies to float32 CPU tensors (and widened bf16 / fp16, above) when this torch build has
the ops and they give the plain product on a probe; everything else (CUDA, bf16 / fp16 with
native instructions, builds without oneDNN) uses `F.linear` on the plain weights. The packed copy
is extra memory (one more copy of the matrices).
"""

from __future__ import annotations

import functools
import platform
import time

import torch
import torch.nn.functional as F

PACKED_DTYPES = (torch.float32,)  # where packing measured clearly faster (see above)


class PlainMatmul:
    """`F.linear` on the plain weights: the fallback everywhere packing does not apply."""

    packs = False
    widens = False  # products in the weights' own dtype

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, w, b)

    def residual_linear(self, x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
        """x + a @ w^T in one BLAS call (beta=1 accumulates into a copy of x)."""
        if b is not None or a.dim() != 2:
            return x + F.linear(a, w, b)
        return torch.addmm(x, a, w.t())


class OneDNNPackedMatmul(PlainMatmul):
    """Weights reordered once into oneDNN's blocked layout where that pays for their shape (see
    `packing_pays`), products through `_linear_pointwise`; the other matrices stay plain and take
    `PlainMatmul`'s path. The tensor tells them apart (`is_mkldnn`)."""

    packs = True  # the forward reads copies: rebuilt after every weight update

    def __init__(self, batch_hint: int, *, pack_all: bool = False):
        self.batch_hint = batch_hint  # the row count the layout is chosen for (decode batch)
        self.pack_all = pack_all  # skip the timing: pack every matrix

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        weight = weight.contiguous()
        if self.pack_all or packing_pays(tuple(weight.shape), self.batch_hint, torch.get_num_threads()):
            return torch.ops.mkldnn._reorder_linear_weight(weight, self.batch_hint)
        return weight

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if not w.is_mkldnn:
            return super().linear(x, w, b)
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")

    def residual_linear(self, x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
        """x + a @ w^T + b with the add fused into the product (x itself is not written)."""
        if not w.is_mkldnn:
            return super().residual_linear(x, a, w, b)
        if a.dim() != 2:
            return x + self.linear(a, w, b)
        return torch.ops.mkldnn._linear_pointwise(a, x.contiguous(), w, b, "add")


ALWAYS_PACK_NUMEL = 1 << 21
"""Matrices this large are packed without timing: packing won for every such shape measured
(1.1-2.6x, docs/benchmarks.md), and timing them would cost a noticeable part of the load."""

PACKING_MARGIN = 0.95
"""The packed product must take at most this fraction of `F.linear`'s time: where the two are
close, plain weights save the memory and the repack after each update."""


@functools.cache
def packing_pays(shape: tuple[int, int], rows: int, threads: int) -> bool:
    """Whether the packed fp32 product of an `shape` weight beats `F.linear` at `rows` rows on
    this CPU with `threads` threads: timed once per process (min of interleaved rounds of a
    few calls each on random data; tens of milliseconds for a model's few shapes).

    Measured: on one AVX-512 CPU packing was 2.3-2.8x faster at every decode shape; on an
    AVX2-only one it was 0.5-0.95x for matrices under ~1M elements (oneDNN's per-call cost
    exceeds BLAS's re-layout there) and 1.1-1.6x above (docs/benchmarks.md)."""
    out_features, in_features = shape
    if out_features * in_features >= ALWAYS_PACK_NUMEL:
        return True
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=gen) * 0.02
    x = torch.randn(rows, in_features, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    plain_call = lambda: F.linear(x, w)  # noqa: E731
    packed_call = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
    with torch.no_grad():
        packed_call()  # oneDNN builds its primitive on the first call
        calls = _calls_per_round(plain_call)
        best_plain = best_packed = float("inf")
        for _ in range(5):
            best_plain = min(best_plain, _round(plain_call, calls))
            best_packed = min(best_packed, _round(packed_call, calls))
    return best_packed < PACKING_MARGIN * best_plain


def _round(call, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    return time.perf_counter() - t0


def _calls_per_round(call, target_s: float = 0.001) -> int:
    """Calls that take about `target_s` (timed after one warm-up call)."""
    call()
    one = _round(call, 1)
    return max(1, min(64, int(target_s / max(one, 1e-7))))


class WidenedMatmul(OneDNNPackedMatmul):
    """bf16 / fp16 weights packed as fp32; activations widened for each product, the result
    rounded back to their dtype (for CPUs without bf16 / fp16 matrix instructions, see above)."""

    widens = True  # the engine keeps its KV cache and attention in fp32 too (model.py)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return super().pack(weight.float())

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return super().linear(x.float(), w, None if b is None else b.float()).to(x.dtype)

    def residual_linear(self, x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
        """x + (a @ w^T + b), the product rounded before the add as in the model's own dtype."""
        return x + self.linear(a, w, b)


# x86 CPU capabilities (torch.cpu.get_capabilities) that multiply each dtype natively
_NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def has_matrix_instructions(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` natively. Only x86 is judged, from torch's CPU
    capabilities; a torch without `torch.cpu.get_capabilities` tells only its vector level, and
    below AVX-512 there are no bf16 / fp16 matrix instructions. Anywhere else, or where it cannot
    tell, the answer is yes, so the plain kernels stay in use."""
    if dtype not in _NATIVE_FLAGS:
        return True
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    if get_capabilities is None:
        return not (platform.machine().lower() in ("x86_64", "amd64")
                    and torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "NO AVX", "AVX2"))
    caps = get_capabilities()
    if caps.get("architecture") != "x86_64":
        return True
    return any(caps.get(flag, False) for flag in _NATIVE_FLAGS[dtype])


@functools.cache
def _onednn_works(dtype: torch.dtype) -> bool:
    """Whether packing exists in this build and reproduces `F.linear` on a small CPU probe."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w, x, r = (torch.randn(*s, generator=gen).to(dtype) for s in ((24, 16), (5, 16), (5, 24)))
        mm = OneDNNPackedMatmul(batch_hint=5, pack_all=True)
        packed = mm.pack(w)
        tol = 1e-4
        return bool(
            torch.allclose(mm.linear(x, packed, None).float(), F.linear(x, w).float(), atol=tol, rtol=tol)
            and torch.allclose(mm.residual_linear(r, x, packed, None).float(), (r + F.linear(x, w)).float(),
                               atol=tol, rtol=tol)
        )
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def matmul_for(like: torch.Tensor, batch_hint: int) -> PlainMatmul:
    """The matmul implementation for weights like `like` (its device and dtype decide)."""
    if not like.is_cpu:
        return PlainMatmul()
    if _onednn_works(like.dtype):
        return OneDNNPackedMatmul(batch_hint)
    if like.dtype in _NATIVE_FLAGS and not has_matrix_instructions(like.dtype) and _onednn_works(torch.float32):
        return WidenedMatmul(batch_hint)
    return PlainMatmul()
