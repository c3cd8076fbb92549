"""`polyrl.train` / `polyrl.sft` from Python: config forms, typed errors (no sys.exit), no Ray
actors left behind, a light `import polyrl`, and docs/python_api.md's examples, run as written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import polyrl
from polyrl.api import nest, resolve_config
from polyrl.config import ConfigError
from polyrl.job import JobConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "python_api.md"


def test_import_polyrl_loads_neither_torch_nor_ray():
    code = ("import sys, polyrl; f = polyrl.train; "
            "heavy = [m for m in ('torch', 'ray', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy; assert callable(polyrl.sft)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sft_is_callable_and_still_the_package():
    import polyrl.sft.config  # binding the package to polyrl.sft keeps it callable

    assert callable(polyrl.sft) and polyrl.sft.config.SFTConfig is polyrl.SFTConfig
    from polyrl.api import sft

    assert polyrl.train is polyrl.api.train and sft is not None


def test_config_forms_resolve_like_the_cli(tmp_path):
    from polyrl.cli.train import EMBEDDED_DEFAULT
    from polyrl.config import load_config

    cli = load_config(JobConfig, files=[EMBEDDED_DEFAULT], overrides=["rollout.n=4", "actor.lr=1e-4"])
    assert resolve_config(JobConfig, {"rollout.n": 4, "actor.lr": 1e-4}, None, EMBEDDED_DEFAULT) == cli
    assert resolve_config(JobConfig, {"rollout": {"n": 4}}, {"actor.lr": 1e-4}, EMBEDDED_DEFAULT) == cli
    path = tmp_path / "job.yaml"
    path.write_text(EMBEDDED_DEFAULT.read_text())
    assert resolve_config(JobConfig, path, {"rollout.n": 4, "actor.lr": 1e-4}, None) == cli
    assert resolve_config(JobConfig, str(path), None, None).rollout.n == 8
    assert resolve_config(JobConfig, cli, None, None) is cli
    assert resolve_config(JobConfig, cli, {"rollout.n": 2}, None).rollout.n == 2
    assert nest({"a.b": 1, "a": {"c": 2}, "d": [1]}) == {"a": {"b": 1, "c": 2}, "d": [1]}


@pytest.mark.parametrize("config, needle", [
    ({"rollout.n": 0}, "rollout.n"),
    ({"no_such.key": 1}, "no_such"),
    ("/nonexistent/job.yaml", "does not exist"),
    (42, "a YAML path, a dict of dotted keys or a JobConfig"),
])
def test_bad_config_raises_config_error_before_anything_starts(config, needle):
    with pytest.raises(ConfigError) as info:
        polyrl.train(config)
    assert any(needle in line for line in info.value.problems), info.value.problems
    with pytest.raises(ConfigError):
        polyrl.sft({"actor.lr": -1} if not isinstance(config, dict) else config)


def test_bad_input_found_at_set_up_raises_its_own_type_not_system_exit(tmp_path):
    from polyrl.data import DataFileError

    with pytest.raises(DataFileError):
        polyrl.train({"data.train_files": [str(tmp_path / "missing.parquet")],
                      "trainer.output_dir": str(tmp_path / "out"), "trainer.progress_bar": False})


def tiny(out, **more):
    return {"trainer.total_steps": 2, "trainer.val_every": 0, "trainer.val_before_train": False,
            "trainer.output_dir": str(out), "trainer.progress_bar": False, "logging.plot_at_end": False,
            "data.val_files": [], **more}


def live_actors() -> list[dict]:
    """The cluster's actors not dead, from the GCS actor table (the state API would need the
    dashboard, which the tests' Ray does not start)."""
    import ray

    return [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]


@pytest.mark.slow
def test_a_call_that_starts_ray_shuts_it_down(tmp_path):
    """In a process of its own: this test process may hold the session's Ray (a full run does),
    and the call must be the one that starts it."""
    code = ("import json, sys, ray, polyrl; assert not ray.is_initialized(); "
            "steps = polyrl.train(json.loads(sys.argv[1]))['steps']; "
            "print(json.dumps({'steps': steps, 'ray_up': ray.is_initialized()}))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(tiny(tmp_path / "a"))], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"steps": 2, "ray_up": False}


@pytest.mark.slow
def test_train_twice_in_one_process_leaves_no_actors(ray_session, tmp_path):
    assert live_actors() == []
    first = polyrl.train(tiny(tmp_path / "a"))
    assert first["steps"] == 2 and (tmp_path / "a" / "summary.json").is_file()
    assert live_actors() == []  # the caller's Ray stays up, the run's actors are gone
    second = polyrl.train(tiny(tmp_path / "b"))
    assert second["steps"] == 2 and live_actors() == []


def doc_blocks(text: str) -> list[tuple[str, str, str | None]]:
    """(language, code, file name) of each fenced block; a `<!-- file: NAME -->` line before a
    block names the file it is."""
    pattern = re.compile(r"(?:<!-- file: (\S+) -->\n)?```(\w+)\n(.*?)```", re.S)
    return [(lang, code, name) for name, lang, code in pattern.findall(text)]


def test_the_doc_has_examples_of_every_form():
    blocks = doc_blocks(DOC.read_text())
    code = "\n".join(c for lang, c, _ in blocks if lang == "python")
    for needle in ("polyrl.train({", 'polyrl.train("my_job.yaml"', "polyrl.train(cfg)", "polyrl.sft({",
                   "except polyrl.ConfigError"):
        assert needle in code
    assert [name for _, _, name in blocks if name] == ["my_job.yaml"]


@pytest.mark.slow
def test_the_doc_examples_run_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for lang, code, name in doc_blocks(DOC.read_text()):
        if name:
            (tmp_path / name).write_text(code)
        elif lang == "python":
            exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - the doc's own code
    out = capsys.readouterr().out
    assert "rollout.n" in out  # the ConfigError example printed its problem
    for run in ("api-demo", "from-yaml", "typed", "sft-demo"):
        assert (tmp_path / "outputs" / run / "summary.json").is_file(), run
    assert not (tmp_path / "outputs" / "never").exists()
    assert Path(namespace["summary"]["policy_dir"]).is_dir()
