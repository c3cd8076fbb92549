"""Shared fixtures: one local Ray instance per test session, temp dirs everywhere."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance shared by every test that needs one (started on first use)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, namespace="polyrl-tests",
                 configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()
