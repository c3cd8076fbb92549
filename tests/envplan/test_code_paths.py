"""PYTHONPATH in the environment plan (polyrl/envplan/code_paths.py): the user's PYTHONPATH and
the directories the config's plugins import from reach every process, with their provenance,
so a plugin named `module:name` imports in every Ray worker (docs/plugins.md)."""

from __future__ import annotations

import os

from polyrl.config.vocabulary import COLOCATED
from polyrl.envplan import PlanContext, build_plan
from polyrl.envplan.code_paths import plugin_dirs
from polyrl.platform import get_platform

CPU = get_platform("cpu")


def test_the_users_pythonpath_is_forwarded_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = build_plan(PlanContext(CPU, "rollout", placement=COLOCATED, mode="sync"), {"PYTHONPATH": f"plugins{os.pathsep}/opt/x"}, {})
    entry = plan["PYTHONPATH"]
    assert entry.value == os.pathsep.join([str(tmp_path / "plugins"), "/opt/x"])
    assert entry.source == "user-env" and "module:name" in entry.reason
    assert plan.runtime_env()["env_vars"]["PYTHONPATH"] == entry.value


def test_plugin_directories_follow_the_users_and_say_where_they_come_from(tmp_path):
    plan = build_plan(PlanContext(CPU, "trainer", placement=COLOCATED, mode="sync"), {"PYTHONPATH": "/opt/x"}, {},
                      code_dirs=[str(tmp_path), "/opt/x"])
    entry = plan["PYTHONPATH"]
    assert entry.value == os.pathsep.join(["/opt/x", str(tmp_path)])
    assert entry.source == "plugins" and str(tmp_path) in entry.reason and "your PYTHONPATH" in entry.reason


def test_no_entry_without_a_pythonpath_a_config_value_wins_and_a_ray_job_places_its_own_code():
    assert "PYTHONPATH" not in build_plan(PlanContext(CPU, "job", placement=COLOCATED, mode="sync"), {}, {})
    config = build_plan(PlanContext(CPU, "job", placement=COLOCATED, mode="sync"), {"PYTHONPATH": "/a"}, {"PYTHONPATH": "/b"}, code_dirs=["/c"])
    assert (config["PYTHONPATH"].value, config["PYTHONPATH"].source) == ("/b", "config")
    job = build_plan(PlanContext(CPU, "job", placement=COLOCATED, mode="sync"), {"PYTHONPATH": "/a", "RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}, {},
                     code_dirs=["/c"])
    assert "PYTHONPATH" not in job


def test_plugin_dirs_are_where_user_packages_are_found_never_installed_ones(tmp_path, monkeypatch):
    (tmp_path / "onpath").mkdir()
    (tmp_path / "onpath" / "code_paths_pkg").mkdir()
    (tmp_path / "onpath" / "code_paths_pkg" / "__init__.py").write_text("")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "code_paths_mod.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "onpath"))
    monkeypatch.chdir(tmp_path / "run")
    specs = ["code_paths_pkg.sub:fn", "code_paths_mod:fn", "json:loads", "torch.nn:Linear",
             "polyrl.agents.calculator:calculator", "/abs/file.py:fn", "grpo", None, "missing_pkg_x:f"]
    assert plugin_dirs(specs) == [str(tmp_path / "onpath"), str(tmp_path / "run")]
