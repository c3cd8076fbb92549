"""What each topology is, as data (polyrl/distributed/topologies.py): the one table the job
schema validates against, the transport builder resolves with and the launch plan reads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from polyrl.config import ConfigError, load_config
from polyrl.distributed.topologies import (COLOCATED, DISAGGREGATED, STREAMING, TOPOLOGY_SPECS, select_topology,
                                           topology_of)
from polyrl.job import JobConfig
from polyrl.weights import WeightSyncConfig, build_transport


def job(*overrides: str) -> JobConfig:
    return load_config(JobConfig, overrides=list(overrides))


def test_placement_and_mode_select_one_topology_each():
    assert select_topology("colocated", "sync") is COLOCATED
    assert select_topology("disaggregated", "sync") is DISAGGREGATED
    assert select_topology("disaggregated", "async") is STREAMING
    with pytest.raises(ValueError, match="trainer.mode=async needs rollout.placement=disaggregated"):
        select_topology("colocated", "async")
    with pytest.raises(ValueError, match="rollout.placement=hybrid is not one of colocated, disaggregated"):
        select_topology("hybrid", "sync")  # an alias is the config's to turn into its name, not the table's
    assert set(TOPOLOGY_SPECS) == {"colocated", "disaggregated", "streaming"}
    assert [s.placement for s in (COLOCATED, DISAGGREGATED, STREAMING)] == ["colocated", "disaggregated",
                                                                         "disaggregated"]
    assert topology_of(job("rollout.placement=disaggregated", "trainer.mode=async")) is STREAMING


def test_each_topology_declares_what_it_is():
    assert (COLOCATED.colocated_engine, COLOCATED.rollout_actors, COLOCATED.on_policy) == (True, "none", True)
    assert (DISAGGREGATED.colocated_engine, DISAGGREGATED.shared_world, DISAGGREGATED.on_policy) == (False, True, True)
    assert (STREAMING.colocated_engine, STREAMING.shared_world, STREAMING.on_policy) == (False, False, False)
    assert [s.mode for s in (COLOCATED, DISAGGREGATED, STREAMING)] == ["sync", "sync", "async"]
    # the first transport is what weights.transport=auto means
    assert [s.transport("auto") for s in (COLOCATED, DISAGGREGATED, STREAMING)] == [
        "in_place", "broadcast", "object_store"]
    assert DISAGGREGATED.transport("object_store") == "object_store"


@pytest.mark.parametrize("spec,transport", [(COLOCATED, "broadcast"), (COLOCATED, "object_store"),
                                            (DISAGGREGATED, "in_place"), (STREAMING, "broadcast"),
                                            (STREAMING, "in_place")])
def test_a_transport_the_topology_cannot_serve_is_refused_the_same_everywhere(spec, transport):
    """The job schema, the transport builder and the table say the same line."""
    expected = spec.refusal.format(transport=transport)
    with pytest.raises(ValueError) as table:
        spec.transport(transport)
    assert str(table.value) == expected
    with pytest.raises(ValueError) as weights:
        build_transport(WeightSyncConfig(transport=transport), spec)
    assert str(weights.value) == expected
    with pytest.raises(ConfigError) as schema:
        job(f"rollout.placement={spec.placement}", f"trainer.mode={spec.mode}", f"weights.transport={transport}")
    assert expected in str(schema.value)


def test_the_job_reads_its_topology_from_the_table():
    cfg = job("rollout.placement=disaggregated", "trainer.mode=async")
    assert cfg.topology is STREAMING and cfg.weight_transport == "object_store"
    assert cfg.resolved_weights.background_publish is True  # overlaps training: off the path
    sync = job("rollout.placement=disaggregated", "weights.transport=object_store")
    assert sync.topology is DISAGGREGATED and sync.resolved_weights.background_publish is False


def test_importing_the_topology_package_loads_no_actor_code():
    """The job schema and the validators read the table without Ray or the workers."""
    code = ("import sys, polyrl.job, polyrl.topology; "
            "print(sorted(m for m in ('ray', 'polyrl.topology.base', 'polyrl.workers.policy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
