"""Shared fixtures: one local Ray instance per test session, temp dirs everywhere."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test helpers (tiny_models)

# The slow tier: end-to-end training runs, CLI subprocess runs, Ray clusters and benchmarks.
# `python -m pytest -m "not slow"` skips them (the unit and component tests, a few minutes on 2
# cores); `python -m pytest -n 2 --dist loadfile` (.ci/run, the README) runs everything, each
# xdist worker with its own local Ray. Keys are node-id prefixes (a
# module, a test, or a test with all its parameters); the numbers are seconds measured on the
# 2-core machine with `--durations`, under load from other work (setup included where it is the
# cost). A test file may also mark itself with @pytest.mark.slow.
SLOW_TESTS = {
    "tests/placement/test_simulated_cluster.py": 339,  # a simulated multi-node Ray cluster
    "tests/rollout/server/test_ray_server.py": 327,  # Ray server actors + router
    "tests/trainer/test_embedded_default.py": 62,
    "tests/trainer/test_interrupt.py::test_sigterm_checkpoints_and_exits_143": 50,
    "tests/trainer/test_interrupt.py::test_second_ctrl_c_abandons_the_step_and_exits_130": 47,
    "tests/trainer/test_interrupt.py::test_sigterm_during_start_up_exits_143_with_a_message": 7,
    "tests/trainer/test_async.py": 93,  # 48 + 25 + 10 + 10
    "tests/trainer/test_standalone.py::test_standalone_embedded_default_learns": 25,
    "tests/trainer/test_standalone.py::test_sync_standalone_over_the_object_store": 20,
    "tests/trainer/test_launch_plan.py::test_plan_equals_a_real_standalone_launch": 14,
    "tests/trainer/test_train_loop.py::test_two_steps_write_metrics_and_summary": 9,
    "tests/trainer/test_train_loop.py::test_kl_loss_uses_reference_and_reports_kl": 10,
    "tests/trainer/test_equivalent_runs.py": 40,  # one 1-rank hybrid run shared by two comparisons
    # the module's `uninterrupted` training run is set up once for these
    "tests/trainer/test_checkpoint_resume.py::test_resume_matches_uninterrupted": 6,
    "tests/trainer/test_checkpoint_resume.py::test_checkpoints_are_pruned_loadable_and_atomic": 1,
    "tests/trainer/test_checkpoint_resume.py::test_incompatible_resume_names_the_field": 1,
    "tests/trainer/test_checkpoint_resume.py::test_harmless_change_is_allowed": 1,
    "tests/trainer/test_checkpoint_resume.py::test_keep_last_prunes": 5,
    "tests/trainer/test_plots.py::test_polyrl_plot_cli": 12,
    "tests/trainer/test_sinks.py::test_wandb_offline_run_without_network": 7,
    # `polyrl train` subprocesses that fail on bad input (6-14 s each: torch + Ray imports)
    "tests/trainer/test_bad_input.py::test_missing_data_file": 9,
    "tests/trainer/test_bad_input.py::test_missing_columns_are_named": 14,
    "tests/trainer/test_bad_input.py::test_corrupt_file": 11,
    "tests/trainer/test_bad_input.py::test_missing_model_path": 8,
    "tests/trainer/test_bad_input.py::test_contradictory_config": 25,  # 4 x ~6
    "tests/trainer/test_bad_input.py::test_engine_not_installed_names_the_extra": 6,
    "tests/trainer/test_bad_input.py::test_print_config_and_help_config": 10,
    "tests/rollout/server/test_serve_cli.py": 7,
    "tests/cli/test_env_doctor.py::test_env_table_and_bad_flags": 20,
    "tests/weights/test_bench_weights.py": 22,
    "tests/weights/test_fp8.py::test_bench_fp8_quick_json": 7,
    "tests/assets/test_tiny_assets.py::test_warm_start_writes_answer_format": 18,
}


def stale_slow_keys(root: Path) -> list[str]:
    """SLOW_TESTS keys naming a file or test that no longer exists: a renamed test would silently
    fall into the fast tier. Checked on the source, so it holds for any test selection."""
    stale = []
    for key in SLOW_TESTS:
        path, _, test = key.partition("::")
        source = root / path
        name = test.split("[")[0]
        if not source.is_file() or (name and f"def {name}(" not in source.read_text()):
            stale.append(key)
    return stale


def slow_key(nodeid: str) -> str | None:
    return next((key for key in SLOW_TESTS
                 if nodeid == key or nodeid.startswith((key + "::", key + "["))), None)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    # before the other implementations (`-m` deselects by marker): mark the slow tier
    stale = stale_slow_keys(Path(__file__).parent.parent)
    if stale:
        raise pytest.UsageError(f"tests/conftest.py SLOW_TESTS names tests that do not exist: {stale}")
    for item in items:
        if slow_key(item.nodeid):
            item.add_marker(pytest.mark.slow)
    yield
    # after them (deselection, pytest's grouping by fixture scope): the longest files first
    cost = estimated_seconds(items)
    # stable: a file's tests keep their order; files of equal cost keep collection order
    items.sort(key=lambda item: -cost[item.nodeid.split("::")[0]])


def estimated_seconds(items) -> dict[str, float]:
    """Test file -> its estimated run time: the SLOW_TESTS seconds of its tests (a module key
    counts once), SLOW_DEFAULT for a slow test without a number, FAST_DEFAULT for any other."""
    cost: dict[str, float] = {}
    counted: set[str] = set()
    for item in items:
        path = item.nodeid.split("::")[0]
        key = slow_key(item.nodeid)
        if key is None:
            seconds = SLOW_DEFAULT if item.get_closest_marker("slow") else FAST_DEFAULT
        elif key in counted:
            seconds = 0.0
        else:
            counted.add(key)
            seconds = SLOW_TESTS[key]
        cost[path] = cost.get(path, 0.0) + seconds
    return cost


SLOW_DEFAULT, FAST_DEFAULT = 8.0, 0.02


def pytest_configure(config):
    # `-n 2 --dist loadfile` hands out whole files, by default the files with the most tests first
    # (xdist's --loadscope-reorder): a one-test file that trains for a minute came last and ran
    # alone at the end. pytest_collection_modifyitems above orders the files longest first
    # instead (longest processing time first: the two workers end together), and xdist keeps
    # that order.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


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
