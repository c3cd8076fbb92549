"""The weight matmuls of the native engine, with CPU weights prepacked for oneDNN where it helps.

On a CPU, `F.linear` hands every call to BLAS, which re-lays the weight out into its blocked
format on each call; for the engine's decode shapes (64 rows x a few hundred to a few thousand
columns) that re-layout is most of the cost. oneDNN can do it once: `mkldnn._reorder_linear_weight`
returns the weight in oneDNN's blocked layout (an opaque tensor) and `mkldnn._linear_pointwise`
multiplies by it, the same pair inductor's CPU freezing pass uses. Measured on the bench machine
(docs/benchmarks.md, Rollout engine): one decode step's projections at 64 rows run 2.4-2.6x faster
than `F.linear` in fp32, and the whole engine 1.5-1.8x faster. Not everywhere: on an AVX2-only
CPU, BLAS's own kernels are good and oneDNN's larger per-call cost made small matrices (under ~1M
elements) 5-50% *slower* packed, while large ones still gained 1.1-1.6x. So whether a weight is
packed is decided by a rule over its shape and the CPU's features (`packing_pays`): every fp32
matrix on an AVX-512 CPU, matrices of 1M+ elements elsewhere; the rest stay plain. The rule is
deliberately not a timing: the packed and plain products differ in the last bits, and a choice
that followed timing noise made two runs with the same seed diverge (the engine's log-probs feed
the PPO ratio). The packed fp32 product sums in a different order from BLAS, so results differ
in the last bits (~1e-6 relative), not more.

bf16 with the CPU's bf16 instructions runs on oneDNN either way (`F.linear` calls it, re-laying the
weight out on every call). Packed, the decode matmuls ran 1.17-1.30x faster on an AVX-512 CPU with
avx512_bf16 and no AMX (AMD Zen 4: the whole 30M decode step 1.10-1.18x, the 4M one unchanged), and
the products, the fused residual add included, are bit-identical to `F.linear` / `addmm` there.
With AMX the engine measured 0.92-1.06x, so bf16 is packed only on avx512_bf16 CPUs without
amx_bf16 (`packing_pays`), and keeps `F.linear` elsewhere.

bf16 and fp16 on an x86 CPU *without* their matrix instructions (no avx512_bf16 / amx_bf16, resp.
no avx512_fp16 / amx_fp16: AVX2-only machines, for one) are another matter: BLAS and oneDNN
emulate those products by converting operands inside the kernel, 5-7x slower than fp32. There the
weights are packed as fp32 and each product runs in fp32 on activations widened from bf16 / fp16,
rounded back to the model's dtype (`WidenedMatmul`). That is the product the native instructions
compute (bf16 x bf16 products are exact in fp32, sums accumulate in fp32, one rounding at the
end); results differ from the emulated kernel only by the summation order, at most one unit in
the last place of bf16 / fp16. The packed fp32 copy costs twice the matrices' bf16 size in memory
(and a repack after an update briefly holds two of them).

Packing applies to float32 CPU tensors, bf16 ones on the CPUs above, and widened bf16 / fp16
(above), when this torch build has the ops and they give the plain product on a probe; everything
else (CUDA, fp16 and bf16 elsewhere with native instructions, builds without oneDNN) uses
`F.linear` on the plain weights. The packed copy is extra memory (one more copy of the matrices).
"""

from __future__ import annotations

import functools
import platform

import torch
import torch.nn.functional as F

PACKED_DTYPES = (torch.float32, torch.bfloat16)  # where packing measured faster, on some CPUs (see above)


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
        self.pack_all = pack_all  # pack every matrix, whatever `packing_pays` says

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        weight = weight.contiguous()
        if self.pack_all or packing_pays(tuple(weight.shape), weight.dtype, cpu_features()):
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


PACK_NUMEL_WITHOUT_AVX512 = 1 << 20
"""Without AVX-512, matrices of this many elements or more are packed: below ~1M elements the
packed product measured 5-50% slower on an AVX2-only CPU (oneDNN's per-call cost exceeds BLAS's
re-layout), around 1M it was 1.0-1.16x faster, above 1.1-1.6x (docs/benchmarks.md, "Packing
timed per shape")."""

AVX512_FLAGS = ("avx512_f", "amx_tile")
"""CPU features under which fp32 packing won at every decode shape (2.3-2.8x, docs/benchmarks.md)."""

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""bf16 is packed with avx512_bf16 and without amx_bf16 (see the module docstring)."""


@functools.cache
def cpu_features() -> frozenset[str]:
    """The x86 features of this CPU that `packing_pays` reads (empty elsewhere). Fixed for the
    process, so every engine in it makes the same choice for the same shape."""
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    if get_capabilities is not None:
        caps = get_capabilities()
        if caps.get("architecture") != "x86_64":
            return frozenset()
        return frozenset(flag for flag in AVX512_FLAGS + BF16_FLAGS if caps.get(flag))
    # an older torch tells only its vector level
    level = torch.backends.cpu.get_cpu_capability()
    return frozenset({"avx512_f"}) if level.startswith("AVX512") else frozenset()


def packing_pays(shape: tuple[int, int], dtype: torch.dtype, features: frozenset[str]) -> bool:
    """Whether a `shape` weight of `dtype` is packed on a CPU with `features` (`cpu_features()`).

    A pure function of its arguments, never a timing: two processes, two runs or a resume on the
    same machine pack the same matrices and so compute the same log-probs to the last bit. float32
    is packed by shape, bf16 whole on avx512_bf16 CPUs without AMX, fp16 never (bf16 / fp16
    without their matrix instructions are widened to float32 first, `WidenedMatmul`)."""
    if dtype == torch.bfloat16:
        return "avx512_bf16" in features and "amx_bf16" not in features
    if dtype != torch.float32:
        return False
    if any(flag in features for flag in AVX512_FLAGS):
        return True
    out_features, in_features = shape
    return out_features * in_features >= PACK_NUMEL_WITHOUT_AVX512


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
        tol = 1e-4 if dtype == torch.float32 else 2e-2
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
    if like.dtype in _NATIVE_FLAGS and not has_matrix_instructions(like.dtype):
        return WidenedMatmul(batch_hint) if _onednn_works(torch.float32) else PlainMatmul()
    if like.dtype == torch.bfloat16 and not packing_pays((1, 1), like.dtype, cpu_features()):
        return PlainMatmul()  # bf16 packs every matrix or none (`packing_pays`)
    if _onednn_works(like.dtype):
        return OneDNNPackedMatmul(batch_hint)
    return PlainMatmul()
