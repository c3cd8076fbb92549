"""`polyrl bench memory`: per-rank peak resident memory of load / step / sync on real gloo ranks."""

from __future__ import annotations

import json

import pytest

from polyrl.cli import bench


@pytest.fixture(scope="module")
def memory():
    return bench.load("memory")


@pytest.mark.slow  # 1 + 2 spawned ranks, each importing torch + transformers: ~1 min on 2 cores
@pytest.mark.timeout(1200)
def test_json_per_world_size_and_fsdp2_shards_the_step(memory, capsys):
    # 10M with allocations of 1 MiB or more returned when freed: with glibc's defaults the freed
    # tensors it keeps (~400 MiB per rank at 30M) would hide the sharding of a model this small
    assert memory.main(["--params", "10M", "--world-sizes", "1,2", "--mmap-threshold-mb", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["cpu_flags"] is not None and len(report["load_average"]) == 3
    assert 8e6 < report["num_params"] < 12e6 and report["mmap_threshold_mb"] == 1
    one, two = report["results"]
    assert [one["world_size"], two["world_size"]] == [1, 2]
    for entry in (one, two):
        assert len(entry["ranks"]) == entry["world_size"]
        for phase in ("load", "step", "sync"):
            assert entry[f"{phase}_mib"] > 0
            assert entry[f"{phase}_mib"] == max(r[f"{phase}_mib"] for r in entry["ranks"])
            assert entry["ratio_vs_1"][phase] == entry[f"{phase}_mib"] / one[f"{phase}_mib"]
    # the resident peak of a step holds at least the fp32 parameters + AdamW state it counts
    model_mib = report["num_params"] * 4 / 2**20
    assert one["step_mib"] > 3 * model_mib
    # FSDP2 shards the load and the training state: about half of each per rank at N=2
    assert two["load_mib"] < 0.6 * one["load_mib"]
    # The step's peak: a rank at N=2 holds half the parameters + AdamW state, so its peak sits at
    # least half of that state below one rank's (measured 179 -> 105 MiB, state 108 MiB: 74 MiB
    # below, bound 54). Not a ratio of the peaks: the activations and the gathered layer vary with
    # the machine's load (a loaded CI run measured 0.614x against a 0.6 ratio bound). Without the
    # sharding, about the activations' half would come off (estimated from the same numbers: ~35 MiB).
    state = one["ranks"][0]["state"]
    assert two["step_mib"] < one["step_mib"] - 0.5 * (state["params"] + state["optimizer"])
    assert two["ranks"][0]["state"]["optimizer"] < 0.51 * one["ranks"][0]["state"]["optimizer"]
    assert report["goal"] == {"world_size": 4, "max_ratio": 0.3, "met": None}  # N=4 not run


@pytest.mark.parametrize("argv, field", [(["--params", "lots"], "--params"), (["--params", "10k"], "--params"),
                                         (["--world-sizes", "1,x"], "--world-sizes"),
                                         (["--world-sizes", "0,2"], "--world-sizes")])
def test_bad_arguments_name_the_flag_and_exit_2(memory, capsys, argv, field):
    assert memory.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {field}") and "\n" not in err


def test_qwen2_shape_is_about_the_requested_size(memory):
    for target in (5e6, 30e6, 300e6, 1.5e9):
        shape = memory.qwen2_shape(int(target))
        assert 0.8 * target < memory.qwen2_params(shape) < 1.2 * target
        assert shape["hidden_size"] % shape["num_attention_heads"] == 0


def test_goal_compares_n4_with_n1(memory):
    results = memory.summarise({1: [{f"{p}{s}": 100.0 for p in memory.PHASES for s in ("_mib", "_rise_mib")}],
                                4: [{"load_mib": 100.0, "step_mib": 26.0, "sync_mib": 31.0, "load_rise_mib": 0,
                                     "step_rise_mib": 0, "sync_rise_mib": 0}]})
    assert results[1]["ratio_vs_1"] == {"load": 1.0, "step": 0.26, "sync": 0.31}
    assert memory.goal(results) == {"load": False, "step": True, "sync": False}
