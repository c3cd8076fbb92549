"""Bucket planning from specs, packing from a stream, and all-or-nothing staging, in one process."""

from __future__ import annotations

import weakref

import pytest
import torch

from gloo_world import DictEngine, model_weights, same_weights
from polyrl.weights import WeightSyncError
from polyrl.weights.base import TensorSpec, WeightStream, as_stream, row_pieces
from polyrl.weights.bucketing import (ALIGN, StagedWeights, flat_staging, iter_buckets, plan_buckets,
                                      staging_views)


def scratch_pool():
    pool: dict[int, torch.Tensor] = {}

    def scratch(b: int, device: torch.device) -> torch.Tensor:
        return pool.setdefault(b % 2, torch.empty(1 << 16, dtype=torch.uint8, device=device))
    return scratch


def test_buckets_follow_the_stream_and_respect_the_budget():
    specs = [TensorSpec("a", (10,), torch.float32), TensorSpec("b", (10,), torch.bfloat16),
             TensorSpec("c", (20,), torch.float32), TensorSpec("d", (100,), torch.float32),
             TensorSpec("e", (5,), torch.float32)]
    manifest = plan_buckets(specs, version=3, bucket_bytes=160)
    assert manifest.version == 3 and manifest.num_tensors == 5
    # a at 0 (40 B), b at 64 (20 B), c would end at 128 + 80 > 160: new bucket; d (400 B) is
    # bigger than the budget: alone; then e. Stream order is kept across dtypes.
    layout = [[(s.name, s.offset) for s in manifest.bucket_slots(i)] for i in range(len(manifest.buckets))]
    assert layout == [[("a", 0), ("b", 64)], [("c", 0)], [("d", 0)], [("e", 0)]]
    assert all(s.offset % ALIGN == 0 for s in manifest.slots)
    assert manifest.total_bytes == 135 * 4 + 10 * 2


def test_pack_and_stage_round_trip_with_mixed_dtypes():
    weights = model_weights(seed=1)
    weights["scalar"] = torch.tensor(2.5)
    weights["transposed"] = torch.randn(4, 6).t()  # not contiguous: packed by a typed copy
    weights["mask"] = torch.tensor([True, False, True])
    stream = as_stream(weights)
    manifest = plan_buckets(stream.specs, version=7, bucket_bytes=1024)
    staged = StagedWeights(manifest)
    for b, flat in iter_buckets(manifest, stream, scratch_pool()):
        staged.buffer(b).copy_(flat)
        staged.mark(b)
    engine = DictEngine(model_weights(seed=0) | {"scalar": torch.tensor(0.0), "transposed": torch.zeros(6, 4),
                                                 "mask": torch.zeros(3, dtype=torch.bool)})
    assert staged.apply(engine) == 7
    assert engine.weight_version == 7 and engine.calls == 1
    assert same_weights(engine.weights, weights)


def test_single_tensor_bucket_is_sent_without_a_copy():
    big = torch.randn(1000)
    stream = as_stream([("big", big), ("small", torch.randn(3))])
    manifest = plan_buckets(stream.specs, 1, bucket_bytes=100)
    b, flat = next(iter_buckets(manifest, stream, scratch_pool()))
    assert b == 0 and flat.data_ptr() == big.data_ptr()


def gathered_stream(weights: dict[str, torch.Tensor], live: list):
    """A stream that makes a fresh tensor for each entry (as a gather from shards does) and
    records, at each production, the bytes of produced tensors still alive anywhere."""
    refs: list = []

    def produce():
        for name, t in weights.items():
            fresh = t.clone()
            refs.append(weakref.ref(fresh))
            live.append(sum(r().nbytes for r in refs if r() is not None))
            yield name, fresh
            del fresh
    return WeightStream([(n, tuple(t.shape), t.dtype) for n, t in weights.items()], produce())


def test_packing_holds_at_most_one_bucket_of_the_stream():
    """Each tensor is pulled when its bucket is packed and released once copied: the bytes of
    produced tensors alive at any time stay within one bucket (plus the tensor being produced)."""
    g = torch.Generator().manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(32, 32, generator=g) for i in range(16)}  # 4 KiB each
    live: list[int] = []
    stream = gathered_stream(weights, live)
    manifest = plan_buckets(stream.specs, 1, bucket_bytes=8 * 1024)
    staged = StagedWeights(manifest)
    for b, flat in iter_buckets(manifest, stream, scratch_pool()):
        staged.buffer(b).copy_(flat)
        staged.mark(b)
    assert len(live) == 16 and max(live) <= 4096 * 2, live
    assert same_weights(staged.tensors(), weights)  # bit-identical
    # the same accounting catches a sender that lists the stream first
    live_listed: list[int] = []
    held = list(gathered_stream(weights, live_listed))
    assert max(live_listed) == 16 * 4096 and len(held) == 16


def test_a_stream_that_drifts_from_its_specs_is_refused():
    weights = model_weights(seed=1)
    specs = [(n, tuple(t.shape), t.dtype) for n, t in weights.items()]
    wrong = [(n, t.t() if 'up_proj' in n else t) for n, t in weights.items()]
    manifest = plan_buckets(WeightStream(specs, []).specs, 1, 1 << 20)
    with pytest.raises(WeightSyncError, match="yielded 'model.layers.0.mlp.up_proj.weight' \\(16, 48\\)"):
        list(iter_buckets(manifest, WeightStream(specs, wrong), scratch_pool()))
    with pytest.raises(WeightSyncError, match="more tensors than the 6 planned"):
        list(iter_buckets(manifest, list(weights.items()) + [("extra", torch.zeros(1))], scratch_pool()))
    short = list(weights.items())[:2]
    with pytest.raises(WeightSyncError, match="ended before"):
        list(WeightStream(specs, short))
    with pytest.raises(WeightSyncError, match="appears twice"):
        WeightStream(specs + specs[:1], [])
    stream = WeightStream(specs, weights.items())
    list(stream)
    with pytest.raises(WeightSyncError, match="consumed once"):
        list(stream)


def test_incomplete_or_wrong_sized_versions_are_never_applied():
    weights = model_weights(seed=2)
    manifest = plan_buckets(as_stream(weights).specs, version=2, bucket_bytes=256)
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


def test_flat_staging_aligns_every_bucket():
    weights = model_weights(seed=4)
    weights["mask"] = torch.tensor([True, False, True])  # 3 bytes: the next bucket is realigned
    weights["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    stream = as_stream(weights)
    manifest = plan_buckets(stream.specs, version=5, bucket_bytes=256)
    starts, total = manifest.stream_layout()
    assert all(s % ALIGN == 0 for s in starts) and total % ALIGN == 0
    flat = flat_staging(manifest).fill_(0xAB)
    views = staging_views(manifest, flat)
    staged = StagedWeights(manifest, views)
    for b, packed in iter_buckets(manifest, stream, scratch_pool()):
        views[b].copy_(packed)
        staged.mark(b)
    engine = DictEngine({k: torch.zeros_like(v) for k, v in weights.items()})
    staged.apply(engine)
    assert same_weights(engine.weights, weights)


def test_staging_of_the_wrong_size_is_refused():
    manifest = plan_buckets(as_stream(model_weights(seed=1)).specs, version=1, bucket_bytes=256)
    with pytest.raises(WeightSyncError, match="staging holds"):
        staging_views(manifest, torch.empty(3, dtype=torch.uint8))


def test_row_pieces_cut_big_tensors_evenly_from_the_spec_alone():
    assert row_pieces((1001, 64), torch.float32, 64 * 1024) == (0, 250, 500, 750, 1001)
    assert row_pieces((10, 4), torch.float32, 160) == ()  # fits whole
    assert row_pieces((1, 1 << 20), torch.float32, 1024) == ()  # one row cannot be cut
    with pytest.raises(WeightSyncError, match="row pieces"):
        WeightStream([TensorSpec("w", (4, 2), torch.float32, (0, 3, 2))], [])


def sliced_stream(weights: dict[str, torch.Tensor], budget: int, live: list[int] | None = None):
    """`weights` as a producer that yields every tensor over `budget` in row slices (fresh
    copies, as a gather makes them), recording the bytes of slices still alive at each yield."""
    specs = [TensorSpec(n, tuple(t.shape), t.dtype, row_pieces(t.shape, t.dtype, budget)) for n, t in weights.items()]
    refs: list = []

    def items():
        for spec in specs:
            t = weights[spec.name]
            for a, b in zip(spec.pieces, spec.pieces[1:]) if spec.pieces else [(0, len(t) if t.dim() else 1)]:
                piece = t[a:b].clone() if spec.pieces else t.clone()
                refs.append(weakref.ref(piece))
                if live is not None:
                    live.append(sum(r().nbytes for r in refs if r() is not None))
                yield spec.name, piece
                del piece
    return WeightStream(specs, items())


def test_sliced_tensor_travels_in_slices_and_arrives_whole():
    weights = model_weights(seed=4) | {"lm_head.weight": torch.randn(1001, 16)}  # 64 KB, odd rows
    budget = 8 * 1024
    probe = sliced_stream(weights, budget)
    assert [len(s.pieces) - 1 for s in probe.specs if s.pieces] == [8]
    manifest = plan_buckets(probe.specs, version=2, bucket_bytes=budget)
    head = [s for s in manifest.slots if s.name == "lm_head.weight"]
    assert [s.rows for s in head] == [(a, b) for a, b in zip(probe.specs[-1].pieces, probe.specs[-1].pieces[1:])]
    assert all(manifest.buckets[s.bucket].num_slots == 1 for s in head)  # each slice alone: zero copy
    starts, _ = manifest.stream_layout()
    for prev, nxt in zip(head, head[1:]):  # back to back in the flat layout
        assert starts[nxt.bucket] == starts[prev.bucket] + prev.nbytes

    live: list[int] = []
    flat_staged = StagedWeights(manifest)  # one flat layout: the slices form the tensor in place
    separate = StagedWeights(manifest, [torch.empty(b.nbytes, dtype=torch.uint8) for b in manifest.buckets])
    for b, packed in iter_buckets(manifest, sliced_stream(weights, budget, live), scratch_pool()):
        for staged in (flat_staged, separate):
            staged.buffer(b).copy_(packed)
            staged.mark(b)
        del packed
    # the sender held one slice or one bucket's tensors at a time, never the 64 KB head
    assert max(live) <= budget < weights["lm_head.weight"].nbytes
    for staged in (flat_staged, separate):
        engine = DictEngine({k: torch.zeros_like(v) for k, v in weights.items()})
        staged.apply(engine)
        assert engine.weight_version == 2 and same_weights(engine.weights, weights)
    head_view = flat_staged.tensors()["lm_head.weight"]
    flat = flat_staged.buffers[0]
    assert head_view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # a view, no copy


def test_iterating_a_sliced_stream_yields_whole_tensors():
    weights = {"a": torch.randn(3, 2), "big": torch.randn(37, 8)}
    stream = sliced_stream(weights, budget=200)
    assert stream.sliced
    got = dict(stream)
    assert list(got) == ["a", "big"] and same_weights(got, weights)
    with pytest.raises(WeightSyncError, match="consumed once"):
        list(stream)
    short = sliced_stream(weights, budget=200)
    items = list(short.pieces())
    broken = WeightStream(short.specs, items[:-1])  # the last slice never comes
    with pytest.raises(WeightSyncError, match="ended before 'big'"):
        list(broken)
