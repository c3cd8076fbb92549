"""The TensorRT-LLM adapter against the real TensorRT-LLM releases, without a GPU: every name it
calls (`ENGINE_CONTRACTS["trtllm"]` in polyrl/backends.py) must exist in each supported release.

TensorRT-LLM's wheels are published on NVIDIA's own index; the `tensorrt-llm` on PyPI is a stub
that downloads them at install time, which a machine reaching only PyPI cannot do. The test
therefore runs where a release's wheel (`tensorrt_llm-<version>-*.whl`, ~1-2 GB) or its unpacked
sources (`tensorrt-llm-<version>-src/tensorrt_llm/...`) lie in `$POLYRL_CONTRACT_WHEELS`, and
skips with that reason elsewhere.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from polyrl.backends import ENGINE_CONTRACTS, ROLLOUT_BACKENDS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_contract_inspect import contract_gaps, engine_source  # noqa: E402

CHECKED = ("1.1.0", "1.2.0", "1.2.1")

slow = pytest.mark.slow


def source(version: str) -> Path:
    cache = os.environ.get("POLYRL_CONTRACT_WHEELS")
    have = cache and (any(Path(cache).glob(f"tensorrt_llm-{version}-*.whl"))
                      or (Path(cache) / f"tensorrt-llm-{version}-src" / ".complete").is_file())
    if not have:
        pytest.skip(f"tensorrt-llm {version}: its wheels are on NVIDIA's index, not PyPI (whose "
                    "tensorrt-llm is a download stub); put tensorrt_llm-<version>-*.whl in "
                    "$POLYRL_CONTRACT_WHEELS to run this")
    return engine_source("tensorrt-llm", "tensorrt_llm", version)


def test_the_checked_releases_are_the_supported_range():
    spec = SpecifierSet(ROLLOUT_BACKENDS.get("trtllm").supported)
    assert all(v in spec for v in CHECKED) and "1.0.0" not in spec and "1.3.0" not in spec


@slow
@pytest.mark.parametrize("version", CHECKED)
def test_every_name_the_adapter_calls_exists(version):
    assert contract_gaps(source(version), ENGINE_CONTRACTS["trtllm"], version) == []


@slow
@pytest.mark.parametrize("version", CHECKED)
def test_sleep_config_is_not_what_these_releases_export(version):
    # issue 28: the adapter imported tensorrt_llm.llmapi.SleepConfig, absent from 1.1 / 1.2
    from polyrl.backends import EngineUse

    assert contract_gaps(source(version), (EngineUse("tensorrt_llm.llmapi:SleepConfig"),), version) \
        == ["tensorrt_llm.llmapi:SleepConfig: tensorrt_llm.llmapi has no SleepConfig"]


# --- placement: TRT-LLM's workers go into the bundles of the actor that starts it (issue 28) -------------

def test_an_engine_host_in_a_placement_group_hands_trtllm_its_replicas_bundles(ray_session):
    ray = ray_session
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from polyrl.rollout.engines.trtllm import BUNDLE_ENV

    @ray.remote(num_cpus=0.25)
    def where(tp, given=None):
        from ray.util import get_current_placement_group

        from polyrl.rollout.engines.trtllm import placement

        try:
            args = placement(tp, given)
        except RuntimeError as exc:
            return str(exc)
        group = args.pop("placement_groups", [None])[0]
        own = get_current_placement_group()
        return args, group is not None and group.id == own.id

    group = placement_group([{"CPU": 0.25}] * 3, strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=120)
    try:
        bundle = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=1)
        told = where.options(scheduling_strategy=bundle, runtime_env={"env_vars": {BUNDLE_ENV: "1"}})
        assert ray.get(told.remote(2), timeout=120) == ({"placement_bundle_indices": [[1, 2]]}, True)
        given = {"placement_bundle_indices": [[0]]}  # the user's (or the plan's) value wins
        assert ray.get(told.remote(1, given), timeout=120) == ({"placement_bundle_indices": [[0]]}, True)
        untold = where.options(scheduling_strategy=bundle)
        assert "POLYRL_PLACEMENT_BUNDLE does not name its bundle" in ray.get(untold.remote(2), timeout=120)
    finally:
        remove_placement_group(group)
    assert ray.get(where.remote(2), timeout=120) == ({}, False)  # no group: nothing added
