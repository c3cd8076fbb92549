"""`actor.packing`'s plan (polyrl/batch/packed.py): the size rule that picks packed or padded
micro-batches, and packs that keep every sample once within the budget."""

from __future__ import annotations

import time

import pytest
import torch

from polyrl.batch import plan_micro_batches
from polyrl.batch.packed import PACK_MIN_PADDING, padding_fraction, plan_layout, plan_packed

LONG_TAIL = [12] * 14 + [30, 200]  # a few long responses among many short ones
UNIFORM = [190, 195, 200, 198, 192, 199, 194, 197]


def test_padding_fraction_of_the_padded_plan():
    # budget 64: [4, 4, 8] -> 3 x 8 = 24 computed for 16 real, then [60] alone
    assert plan_micro_batches([4, 8, 4, 60], 64) == [[0, 2, 1], [3]]
    assert padding_fraction([4, 8, 4, 60], 64) == pytest.approx(1 - 76 / 84)
    assert padding_fraction([], 64) == 0.0


def test_auto_packs_only_where_padding_is_large(monkeypatch):
    def no_timing():
        raise AssertionError("the packing choice must not time anything")

    monkeypatch.setattr(time, "perf_counter", no_timing)
    assert padding_fraction(LONG_TAIL, 512) >= PACK_MIN_PADDING > padding_fraction(UNIFORM, 512)
    packed, plan = plan_layout(LONG_TAIL, 512, "auto")
    assert packed and plan == plan_packed(LONG_TAIL, 512)
    packed, plan = plan_layout(UNIFORM, 512, "auto")
    assert not packed and plan == plan_micro_batches(UNIFORM, 512)
    assert plan_layout(UNIFORM, 512, "on")[0] and not plan_layout(LONG_TAIL, 512, "off")[0]
    assert plan_layout(torch.tensor(LONG_TAIL), 512, "auto")[0]
    with pytest.raises(ValueError, match="actor.packing='yes'"):
        plan_layout(LONG_TAIL, 512, "yes")


def test_packs_hold_every_sample_once_within_the_budget():
    lengths = [5, 30, 7, 12, 3, 20, 40]
    packs = plan_packed(lengths, 32)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert [6] in packs  # longer than the budget: alone
    assert all(sum(lengths[i] for i in p) <= 32 for p in packs if p != [6])
