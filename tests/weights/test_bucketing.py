"""Bucket planning, packing and all-or-nothing staging, in one process."""

from __future__ import annotations

import pytest
import torch

from gloo_world import DictEngine, model_weights, same_weights
from polyrl.weights import WeightSyncError
from polyrl.weights.bucketing import (ALIGN, StagedWeights, as_bytes, flat_staging, pack_bucket,
                                      pack_range, plan_buckets, staging_views, stream_pieces)


def test_buckets_hold_one_dtype_and_respect_the_budget():
    items = [("a", torch.zeros(10)), ("b", torch.zeros(10, dtype=torch.bfloat16)),
             ("c", torch.zeros(20)), ("d", torch.zeros(100)), ("e", torch.zeros(5))]
    manifest, ordered = plan_buckets(items, version=3, bucket_bytes=30 * 4)
    assert manifest.version == 3 and manifest.num_tensors == 5
    # fp32: [a, c] = 30 elements fill the budget; d (100) is bigger than it: alone; then e.
    layout = [(b.dtype, [s.name for s in manifest.bucket_slots(i)]) for i, b in enumerate(manifest.buckets)]
    assert layout == [("float32", ["a", "c"]), ("float32", ["d"]), ("float32", ["e"]),
                      ("bfloat16", ["b"])]
    assert manifest.total_bytes == 135 * 4 + 10 * 2
    assert [t.numel() for t in ordered] == [10, 20, 100, 5, 10]


def test_pack_and_stage_round_trip_with_mixed_dtypes():
    weights = model_weights(seed=1)
    weights["scalar"] = torch.tensor(2.5)
    weights["transposed"] = torch.randn(4, 6).t()  # not contiguous: packed by copy
    manifest, ordered = plan_buckets(list(weights.items()), version=7, bucket_bytes=1024)
    staged = StagedWeights(manifest)
    for b in range(len(manifest.buckets)):
        staged.buffer(b).copy_(as_bytes(pack_bucket(manifest, b, ordered)))
        staged.mark(b)
    engine = DictEngine(model_weights(seed=0) | {"scalar": torch.tensor(0.0),
                                                 "transposed": torch.zeros(6, 4)})
    assert staged.apply(engine) == 7
    assert engine.weight_version == 7 and engine.calls == 1
    assert same_weights(engine.weights, weights)


def test_single_tensor_bucket_is_sent_without_a_copy():
    big = torch.randn(1000)
    manifest, ordered = plan_buckets([("big", big), ("small", torch.randn(3))], 1, bucket_bytes=100)
    assert pack_bucket(manifest, 0, ordered).data_ptr() == big.data_ptr()


def test_incomplete_or_wrong_sized_versions_are_never_applied():
    weights = model_weights(seed=2)
    manifest, _ = plan_buckets(list(weights.items()), version=2, bucket_bytes=256)
    assert len(manifest.buckets) > 2
    engine = DictEngine(model_weights(seed=0))
    staged = StagedWeights(manifest)
    staged.mark(0)
    with pytest.raises(WeightSyncError, match="incomplete.*never arrived"):
        staged.apply(engine)
    assert engine.weight_version == 0 and engine.calls == 0
    bad = [torch.empty(b.nbytes + (1 if i == 1 else 0), dtype=torch.uint8)
           for i, b in enumerate(manifest.buckets)]
    staged = StagedWeights(manifest, bad)
    with pytest.raises(WeightSyncError, match="bucket 1"):
        staged.mark(1)
    with pytest.raises(WeightSyncError, match="not a manifest|expected a weight manifest"):
        StagedWeights({"version": 1})


@pytest.mark.parametrize("chunk", [3, 64, 1000, 1 << 20])
def test_any_chunking_of_the_stream_stages_every_tensor_exactly(chunk):
    weights = model_weights(seed=4)
    weights["mask"] = torch.tensor([True, False, True])  # 3 bytes: the next bucket is realigned
    weights["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    weights["transposed"] = torch.randn(4, 6).t()
    manifest, ordered = plan_buckets(list(weights.items()), version=5, bucket_bytes=256)
    starts, total = manifest.stream_layout()
    assert all(s % ALIGN == 0 for s in starts) and total % ALIGN == 0
    assert total >= manifest.total_bytes
    pieces = stream_pieces(manifest, ordered)
    flat = flat_staging(manifest).fill_(0xAB)
    for lo in range(0, total, chunk):  # what the ring does: pack a chunk, copy it out
        slot = torch.empty(min(chunk, total - lo), dtype=torch.uint8)
        pack_range(pieces, lo, slot)
        flat[lo: lo + slot.numel()].copy_(slot)
    staged = StagedWeights(manifest, staging_views(manifest, flat))
    for b in range(len(manifest.buckets)):
        staged.mark(b)
    engine = DictEngine({k: torch.zeros_like(v) for k, v in weights.items()})
    staged.apply(engine)
    assert same_weights(engine.weights, weights)


def test_staging_of_the_wrong_size_is_refused():
    manifest, _ = plan_buckets(list(model_weights(seed=1).items()), version=1, bucket_bytes=256)
    with pytest.raises(WeightSyncError, match="staging holds"):
        staging_views(manifest, torch.empty(3, dtype=torch.uint8))
