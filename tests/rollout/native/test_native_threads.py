"""The native engine's thread count follows the free cores (threads.py): the rule over
/proc/stat-like samples, pure, and its wiring into the engine."""

from __future__ import annotations

import os

import pytest
import torch

from polyrl.rollout.base import SamplingParams
from polyrl.rollout.native import threads
from polyrl.rollout.native.engine import NativeEngine
from polyrl.rollout.native.threads import (CpuSample, FreeCoreThreads, cgroup_cpu_limit, free_cores,
                                           parse_proc_stat, threads_for, window_start)

STAT = """cpu  300 20 100 1000 5 1 2 3 0 0
cpu0 100 10 50 500 5 0 1 2 0 0
cpu1 200 10 50 500 0 1 1 1 0 0
intr 1 2 3
"""


def sample(wall: float, own: float, **cores: tuple[int, ...]) -> CpuSample:
    """cores: cpuN=(busy ticks, all ticks) or (busy, nice, all)."""
    return CpuSample(wall, own, {int(k[3:]): v if len(v) == 3 else (v[0], 0, v[1]) for k, v in cores.items()})


def test_proc_stat_lines_give_busy_nice_and_all_ticks_per_core():
    # busy = user + system + irq + softirq + steal; idle and iowait are free
    assert parse_proc_stat(STAT) == {0: (100 + 50 + 0 + 1 + 2, 10, 668), 1: (200 + 50 + 1 + 1 + 1, 10, 763)}


@pytest.mark.parametrize("second,own_s,allowed,expected_free,expected_threads", [
    ((10, 100), 0.0, {0, 1}, 1.9, 2),      # an idle machine (a tick of noise): both cores
    ((100, 100), 0.0, {0, 1}, 1.0, 1),     # one busy competitor on core 1: one thread
    ((50, 100), 0.0, {0, 1}, 1.5, 1),      # half a core taken: a core counts only 75% free
    ((20, 100), 0.0, {0, 1}, 1.8, 2),      # a light neighbour: both
    ((100, 100), 1.0, {0, 1}, 2.0, 2),     # core 1 busy with this process itself: both
    ((100, 100), 0.0, {0}, 1.0, 1),        # affinity to core 0 only: its own share
])
def test_free_cores_and_the_thread_count(second, own_s, allowed, expected_free, expected_threads):
    before = sample(0.0, 0.0, cpu0=(0, 0), cpu1=(0, 0))
    after = sample(1.0, own_s, cpu0=(0, 100), cpu1=second)
    free = free_cores(before, after, allowed, niced=False)
    assert free == pytest.approx(expected_free)
    assert threads_for(free, len(allowed), limit=8) == expected_threads


def test_niced_work_counts_free_for_a_normal_process_and_busy_for_a_niced_one():
    before = sample(0.0, 0.0, cpu0=(0, 0, 0), cpu1=(0, 0, 0))
    # a nice 19 loop on core 1 (the nice column): it yields to a process at nice 0, both cores free
    niced_loop = sample(1.0, 0.0, cpu0=(0, 0, 100), cpu1=(0, 100, 100))
    assert free_cores(before, niced_loop, {0, 1}, niced=False) == 2.0
    # to a Ray worker (nice 15) the same loop is an equal: one core
    assert free_cores(before, niced_loop, {0, 1}, niced=True) == 1.0
    # the niced worker's own time, in the nice column too, is its own to reuse: both cores
    own_on_core_1 = sample(1.0, 1.0, cpu0=(0, 0, 100), cpu1=(0, 100, 100))
    assert free_cores(before, own_on_core_1, {0, 1}, niced=True) == 2.0
    # and a nice 0 competitor is busy to it as to anyone
    assert free_cores(before, sample(1.0, 0.0, cpu0=(0, 0, 100), cpu1=(100, 0, 100)), {0, 1}, niced=True) == 1.0


def test_the_count_is_capped_and_never_zero():
    assert threads_for(0.0, allowed=2, limit=2) == 1        # every core taken: still one thread
    assert threads_for(16.0, allowed=16, limit=4) == 4       # the reservation / torch's count caps it
    assert threads_for(16.0, allowed=3, limit=8) == 3        # the affinity caps it
    assert threads_for(None, allowed=4, limit=2) == 2        # unknown load: the most allowed
    assert free_cores(sample(0.0, 0.0), sample(1.0, 0.0), {0}, niced=False) is None  # no core read


def test_window_is_the_latest_one_long_enough():
    ring = [sample(t, 0.0) for t in (0.0, 0.1, 0.2, 0.3, 0.4)]
    assert window_start(ring, now=0.65, length=0.5).wall_s == 0.1
    assert window_start(ring, now=0.3, length=0.5) is None


@pytest.mark.parametrize("text,expected", [("max 100000\n", None), ("150000 100000\n", 1),
                                           ("400000 100000\n", 4), ("50000 100000\n", 1)])
def test_cgroup_quota_in_whole_cpus(tmp_path, text, expected):
    path = tmp_path / "cpu.max"
    path.write_text(text)
    assert cgroup_cpu_limit(str(path)) == expected
    assert cgroup_cpu_limit(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("bad", [0, -1, True, "2", 1.5])
def test_a_bad_thread_count_names_the_argument(bad):
    with pytest.raises(ValueError, match="num_threads"):
        FreeCoreThreads(bad)


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[12, 34, 56], [7, 8, 9, 10]]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the free cores are read from /proc/stat")
def test_engine_follows_a_busy_neighbour_and_gives_the_caller_its_count_back(qwen3_dir, monkeypatch, two_threads):
    # the window the engine reads: core 1 busy all along with another process's work
    window = (sample(0.0, 0.0, cpu0=(0, 0), cpu1=(0, 0)), sample(1.0, 0.0, cpu0=(5, 100), cpu1=(100, 100)))
    monkeypatch.setattr(threads._SAMPLER, "window", lambda length: window)
    monkeypatch.setattr(threads, "allowed_cpus", lambda: {0, 1})
    engine = NativeEngine(qwen3_dir, max_model_len=64, max_num_seqs=8)
    assert engine.health()["threads"] == 1 and engine.health()["free_cores"] == pytest.approx(0.95)
    seen = []
    step = engine._sched.step
    monkeypatch.setattr(engine._sched, "step", lambda: seen.append(torch.get_num_threads()) or step())
    out = engine.generate_batch(PROMPTS, GREEDY)
    assert set(seen) == {1} and torch.get_num_threads() == 2  # the steps at 1, the caller's 2 back
    # the neighbour gone: the next decision takes both cores again
    window = (window[0], sample(1.0, 0.0, cpu0=(5, 100), cpu1=(3, 100)))
    engine._threads._decided = float("-inf")
    seen.clear()
    assert engine.generate_batch(PROMPTS, GREEDY) == out and set(seen) == {2}


def test_a_pinned_count_ignores_the_load_and_computes_the_same(qwen3_dir, monkeypatch, two_threads):
    monkeypatch.setattr(threads._SAMPLER, "window", lambda length: pytest.fail("a pinned count reads no load"))
    outs = {}
    for n in (1, 2):
        engine = NativeEngine(qwen3_dir, max_model_len=64, max_num_seqs=8, num_threads=n)
        assert engine.health()["threads"] == n
        outs[n] = engine.generate_batch(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True, seed=3))
        assert torch.get_num_threads() == 2
    # the count changes no bit of the tokens or log-probs (docs/native_engine.md)
    assert [[(o.token_ids, o.logprobs) for o in g] for g in outs[1]] == \
        [[(o.token_ids, o.logprobs) for o in g] for g in outs[2]]


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the free cores are read from /proc/stat")
def test_a_training_rank_update_runs_on_the_free_cores_and_restores_its_count(monkeypatch, two_threads):
    # PolicyWorker.update's block: one decision on entry, the rank's own count (2) back after it
    window = (sample(0.0, 0.0, cpu0=(0, 0), cpu1=(0, 0)), sample(1.0, 0.0, cpu0=(0, 100), cpu1=(100, 100)))
    monkeypatch.setattr(threads._SAMPLER, "window", lambda length: window)
    monkeypatch.setattr(threads, "allowed_cpus", lambda: {0, 1})
    rank = FreeCoreThreads()
    assert rank.limit == 2
    with rank.applied() as count:
        assert count == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
