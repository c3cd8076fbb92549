"""Shared fixtures: one local Ray instance per test session, temp dirs everywhere."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test helpers (tiny_models)


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance shared by every test that needs one (started on first use)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="polyrl-tests",
                 configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A random 2-layer Qwen2 with a char-level tokenizer (chat template included)."""
    from tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def arith_files(tmp_path_factory) -> dict:
    from tiny_models import write_arithmetic

    return write_arithmetic(tmp_path_factory.mktemp("arith"))
