"""KV cache capacity (kv_cache.py): small growth steps, shrinking for in-place attention, and
decode over the whole capacity (masked) giving what decode over a `[:L]` slice gives."""

from __future__ import annotations

import pytest
import torch

from polyrl.rollout.base import SamplingParams
from polyrl.rollout.native.engine import NativeEngine
from polyrl.rollout.native.kv_cache import KVCache


def _cache(dtype=torch.bfloat16, max_len=4096):
    return KVCache(2, 1, 4, max_slots=4, max_len=max_len, dtype=dtype, device=torch.device("cpu"))


def test_capacity_grows_by_an_eighth_in_multiples_of_32():
    cache = _cache()
    seen = []
    for length in range(1, 700):
        cache.reserve(2, length)
        assert cache.attends_in_place(length)  # growing never leaves it too large to
        if not seen or seen[-1] != cache.capacity:
            seen.append(cache.capacity)
    assert seen == [32, 64, 96, 128, 160, 192, 224, 256, 288, 352, 416, 480, 544, 640, 736]
    cache = _cache(max_len=100)
    cache.reserve(1, 99)
    assert cache.capacity == 100  # never past max_len


@pytest.mark.parametrize("dtype,shrinks", [(torch.bfloat16, True), (torch.float32, False)])
def test_fit_shrinks_a_bf16_cache_keeping_the_live_positions(dtype, shrinks):
    cache = _cache(dtype)
    cache.reserve(3, 500)
    assert cache.capacity == 512
    cache.k.copy_(torch.randn(cache.k.shape))
    cache.v.copy_(torch.randn(cache.v.shape))
    k, v = cache.k[..., :40].clone(), cache.v[:, :, :, :40].clone()
    cache.fit(3, 40)
    # bf16: the positions past 40 are dead, so the cache shrinks to attend in place; fp32 reads
    # a slice in place anyway and keeps its buffers
    assert cache.capacity == (64 if shrinks else 512) and cache.slots == 4
    assert cache.attends_in_place(40) == shrinks
    assert torch.equal(cache.k[..., :40], k) and torch.equal(cache.v[:, :, :, :40], v)


@pytest.fixture(scope="module")
def bf16_engine(model_dirs):
    return NativeEngine(model_dirs["qwen2"], dtype="bfloat16", max_model_len=128, max_num_seqs=4, tokenizer=False)


def test_decode_over_the_whole_capacity_masks_the_tail(bf16_engine, monkeypatch):
    """The positions past each sequence's end are masked: garbage there changes nothing, and
    attending over the capacity agrees with attending over a `[:L]` slice."""
    model, cache = bf16_engine._sched.model, bf16_engine._sched.cache
    gen = torch.Generator().manual_seed(0)
    tokens, positions = torch.tensor([5, 6, 7]), torch.tensor([20, 9, 14])
    L = 21
    with torch.inference_mode():
        cache.reserve(3, L)
        cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
        cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
        assert cache.capacity == 32 and cache.attends_in_place(L)
        in_place = model.decode(tokens, positions, cache, L)
        cache.k[..., L:] = 1e4  # garbage in every position no sequence attends to
        cache.v[:, :, :, L:] = -1e4
        assert torch.equal(model.decode(tokens, positions, cache, L), in_place)
        monkeypatch.setattr(KVCache, "attends_in_place", lambda self, length: False)
        sliced = model.decode(tokens, positions, cache, L)
    torch.testing.assert_close(in_place, sliced, atol=0.05, rtol=0)


def test_a_long_generation_then_a_short_one(bf16_engine, model_dirs):
    """After long sequences the cache shrinks for short ones; their tokens are a fresh engine's."""
    greedy = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    bf16_engine.generate_batch([[3, 4, 5]], greedy)
    assert bf16_engine._sched.cache.capacity >= 103
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = bf16_engine.generate_batch([[9, 8, 7, 6]], short)
    assert bf16_engine._sched.cache.capacity == 32
    fresh = NativeEngine(model_dirs["qwen2"], dtype="bfloat16", max_model_len=128, max_num_seqs=4, tokenizer=False)
    assert got == fresh.generate_batch([[9, 8, 7, 6]], short)
