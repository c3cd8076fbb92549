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
# 2-core machine with `--durations` / --junitxml in a full `-n 2` run under load from other work
# (load ~8: about twice the unloaded time; setup included where it is the cost). A test file may
# also mark itself with @pytest.mark.slow (its numbers, if any, are in SECONDS). The numbers
# also order the files (pytest_collection_modifyitems).
SLOW_TESTS = {
    "tests/placement/test_simulated_cluster.py": 235,  # a simulated multi-node Ray cluster
    "tests/rollout/server/test_ray_server.py": 30,  # Ray server actors + router
    "tests/trainer/test_embedded_default.py": 114,
    "tests/trainer/test_interrupt.py::test_sigterm_checkpoints_and_exits_143": 45,
    "tests/trainer/test_interrupt.py::test_second_ctrl_c_abandons_the_step_and_exits_130": 52,
    "tests/trainer/test_interrupt.py::test_sigterm_during_start_up_exits_143_with_a_message": 4,
    "tests/trainer/test_interrupt.py::test_sigterm_while_ray_and_the_actors_start_exits_143_with_a_message": 12,
    "tests/trainer/test_interrupt.py::test_sigterm_while_the_driver_waits_on_the_ranks_set_up_exits_143": 30,
    "tests/trainer/test_checkpoint_resume.py::test_fsdp2_run_of_two_ranks_resumes_on_one": 27,
    "tests/test_python_api.py::test_the_doc_examples_run_as_written": 30,
    "tests/test_python_api.py::test_train_twice_in_one_process_leaves_no_actors": 29,
    "tests/trainer/test_async.py": 146,  # 50 + 35 + 33 + 29
    "tests/trainer/test_standalone.py::test_standalone_embedded_default_learns": 54,
    "tests/trainer/test_standalone.py::test_sync_standalone_over_the_object_store": 24,
    "tests/trainer/test_launch_plan.py::test_plan_equals_a_real_standalone_launch": 69,
    "tests/trainer/test_train_loop.py::test_kl_loss_uses_reference_and_reports_kl": 26,
    "tests/trainer/test_reference_run.py": 95,  # one 1-rank hybrid run shared by three tests
    # the module's `uninterrupted` training run is set up once for these
    "tests/trainer/test_checkpoint_resume.py::test_resume_matches_uninterrupted": 132,
    "tests/trainer/test_checkpoint_resume.py::test_checkpoints_are_pruned_loadable_and_atomic": 1,
    "tests/trainer/test_checkpoint_resume.py::test_incompatible_resume_names_the_field": 12,
    "tests/trainer/test_checkpoint_resume.py::test_harmless_change_is_allowed": 21,
    "tests/trainer/test_checkpoint_resume.py::test_keep_last_prunes": 17,
    "tests/trainer/test_plots.py::test_polyrl_plot_cli": 8,
    "tests/trainer/test_sinks.py::test_wandb_offline_run_without_network": 5,
    # a `polyrl train` subprocess that fails on bad input (torch + Ray imports)
    "tests/trainer/test_bad_input.py::test_missing_data_file": 19,
    "tests/rollout/server/test_serve_cli.py": 18,
    "tests/cli/test_env_doctor.py::test_env_table_and_bad_flags": 10,
    "tests/weights/test_bench_weights.py": 13,
    "tests/weights/test_fp8.py::test_bench_fp8_quick_json": 10,
    "tests/assets/test_tiny_assets.py::test_warm_start_writes_answer_format": 18,
}

SECONDS = {
    "tests/trainer/test_recipes.py": 144,
    "tests/agents/test_async_agents.py::test_training_with_agents": 71,
    "tests/sft/test_sft_run.py::test_two_processes_train_like_one": 33,
    "tests/sft/test_sft_run.py::test_checkpoint_is_a_model_path_for_polyrl_train": 21,
    "tests/trainer/test_reproducible.py": 56,
    "tests/training/test_fsdp2_lora.py": 54,
    "tests/training/test_fsdp2_lora_e2e.py": 43,
    "tests/distributed/test_replica_weight_path.py": 41,
    "tests/training/test_fsdp2.py::test_resume_on_one_rank_and_on_two": 22,
    "tests/training/test_fsdp2.py::test_checkpointing_offload_ddp_resume_and_mismatch": 16,
    "tests/rewards/test_reward_model.py::test_dead_reward_worker_scores_zero_and_counts": 18,
    "tests/rewards/test_reward_model.py::test_ray_reward_worker_scores_like_the_runner": 13,
    "tests/trainer/test_standalone.py::test_a_two_rank_replica_generates_on_its_leader_and_takes_"
    "weights_through_it": 27,
    "tests/training/test_compile_step.py::test_compiled_engine_trains_like_eager": 60,  # cold cache
    "tests/weights/test_fsdp2_sync.py": 20,
    "tests/agents/test_calculator_recipe.py::test_one_step_of_the_recipe": 19,
    # session 9's (a full -n 2 run at load ~8, 2026-12-04)
    "tests/plugins/test_user_plugins.py": 60,
    "tests/benchmarks/test_bench_memory.py": 50,
    "tests/trainer/test_distill_run.py": 110,
    "tests/trainer/test_sequence_parallel_run.py": 47,
    "tests/training/test_sequence_parallel.py": 90,
    "tests/placement/test_trtllm_placement.py": 120,
    "tests/rollout/test_engine_plugin_run.py": 60,
    "tests/training/test_sharded_load.py": 50,
    "tests/training/test_mesh_driver.py": 30,
    # session 10's (measured under load ~16-25 by their authors)
    "tests/training/test_vlm_training.py": 60,
    "tests/assets/test_vision_shapes_recipe.py": 27,
}
"""Seconds (measured as SLOW_TESTS's) of tests marked slow in their own files, by node-id prefix:
only used to order the files, so a key that no longer matches is harmless."""


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
    """Test file -> its estimated run time: the SLOW_TESTS / SECONDS numbers of its tests (a key
    counts once), SLOW_DEFAULT for a slow test without a number, FAST_DEFAULT for any other."""
    cost: dict[str, float] = {}
    counted: set[str] = set()
    for item in items:
        path = item.nodeid.split("::")[0]
        key = slow_key(item.nodeid)
        if key is None:
            key = next((k for k in SECONDS if item.nodeid.startswith(k)), None)
        if key is None:
            seconds = SLOW_DEFAULT if item.get_closest_marker("slow") else FAST_DEFAULT
        elif key in counted:
            seconds = 0.0
        else:
            counted.add(key)
            seconds = SLOW_TESTS.get(key) or SECONDS[key]
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
