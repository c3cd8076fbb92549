"""The one plugin loader (`polyrl.registry.load_plugin`, docs/plugins.md): "package.module:name"
and "/path/to/file.py:name", each failure a PluginLoadError whose message is one line; and a
scan that keeps it the only loader in polyrl/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from polyrl.registry import PluginLoadError, load_plugin

POLYRL = Path(__file__).resolve().parents[2] / "polyrl"

# Loading code by a path is the loader's job (polyrl/registry.py). These import only polyrl's own
# modules or files, named in polyrl, never a path a user gives:
ALLOWED = {
    "polyrl/__init__.py": "lazy attributes of the package itself (polyrl.sft, ...)",
    "polyrl/cli/main.py": "the CLI's own sub-command modules",
    "polyrl/cli/bench.py": "the benchmark scripts shipped in benchmarks/",
    "polyrl/rollout/native/vision.py": "the vision towers of polyrl's own table",
}
LOADING = re.compile(r"spec_from_file_location|importlib\.import_module\(|\bimport_target\(|exec_module\(")


def test_no_second_plugin_loader():
    found = {}
    for path in sorted(POLYRL.rglob("*.py")):
        rel = path.relative_to(POLYRL.parent).as_posix()
        if rel == "polyrl/registry.py" or rel in ALLOWED:
            continue
        hits = [n for n, line in enumerate(path.read_text().splitlines(), 1) if LOADING.search(line)]
        if hits:
            found[rel] = hits
    assert not found, (f"code loaded by path outside polyrl/registry.py: {found}; call "
                       "polyrl.registry.load_plugin (or add the file to ALLOWED if it loads only polyrl's own modules)")
    for rel in ALLOWED:  # an allowed file that no longer loads anything leaves the list
        assert LOADING.search((POLYRL.parent / rel).read_text()), rel


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


def test_module_path_and_file_path(tmp_path):
    assert load_plugin("polyrl.registry:load_plugin", "polyrl_test_") is load_plugin
    plugin = tmp_path / "plugins.py"
    plugin.write_text("def score(x):\n    return x + 1\nLIMIT = 3\n")
    fn = load_plugin(f"{plugin}:score", "polyrl_test_")
    assert fn(1) == 2
    assert load_plugin(f"{plugin}:score", "polyrl_test_") is fn  # loaded once per process
    assert load_plugin(f"{plugin}:LIMIT", "polyrl_test_") == 3
    other = tmp_path / "sub" / "plugins.py"  # the same file name elsewhere does not collide
    other.parent.mkdir()
    other.write_text("def score(x):\n    return -x\n")
    assert load_plugin(f"{other}:score", "polyrl_test_")(1) == -1 and fn(1) == 2


def test_missing_attribute_lists_what_is_defined(tmp_path):
    plugin = tmp_path / "tools.py"
    plugin.write_text("from os.path import join\nLIMIT = 3\ndef word_count(t):\n    return 1\n")
    with pytest.raises(PluginLoadError) as info:
        load_plugin(f"{plugin}:nope", "polyrl_test_")
    assert info.value.stage == "attribute"
    assert _one_line(info.value) == (f"'{plugin}:nope': '{plugin}' has no 'nope'; defined there: word_count")
    with pytest.raises(PluginLoadError, match="has no 'LIMIT'"):  # present, but not a function
        load_plugin(f"{plugin}:LIMIT", "polyrl_test_", callable_only=True)


def test_missing_file_module_and_form(tmp_path):
    with pytest.raises(PluginLoadError) as info:
        load_plugin(f"{tmp_path}/missing.py:f", "polyrl_test_")
    assert info.value.stage == "file" and isinstance(info.value.cause, FileNotFoundError)
    assert _one_line(info.value) == f"'{tmp_path}/missing.py:f': file {tmp_path}/missing.py does not exist"
    with pytest.raises(PluginLoadError) as info:
        load_plugin("no_such_pkg_xyz.mod:f", "polyrl_test_")
    assert info.value.stage == "import" and isinstance(info.value.cause, ModuleNotFoundError)
    assert _one_line(info.value) == ("'no_such_pkg_xyz.mod:f': cannot import 'no_such_pkg_xyz.mod': "
                                     "No module named 'no_such_pkg_xyz'")
    with pytest.raises(PluginLoadError) as info:
        load_plugin("just_a_name", "polyrl_test_")
    assert info.value.stage == "form"
    assert _one_line(info.value) == "'just_a_name' must look like package.module:name or /path/to/file.py:name"


def test_module_that_raises_is_one_line_and_not_kept(tmp_path):
    plugin = tmp_path / "broken.py"
    plugin.write_text("x = 1 / 0\n")
    with pytest.raises(PluginLoadError) as info:
        load_plugin(f"{plugin}:f", "polyrl_test_")
    assert info.value.stage == "raised" and isinstance(info.value.cause, ZeroDivisionError)
    assert _one_line(info.value) == f"'{plugin}:f': importing '{plugin}' raised ZeroDivisionError: division by zero"
    plugin.write_text("def f():\n    return 5\n")  # fixed: loaded afresh, not the failed half
    assert load_plugin(f"{plugin}:f", "polyrl_test_")() == 5
