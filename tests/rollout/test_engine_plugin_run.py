"""A rollout backend from a user's package outside polyrl runs end to end, named by import path
(`rollout.backend: package.module:Class`) or by the name its distribution registers in the
`polyrl.rollout_backends` entry-point group: the package is on the PYTHONPATH of a real `polyrl
train`, and its engine (the built-in engine, subclassed) is imported, built and generates inside
the Ray actor that hosts rollout (the rollout worker; the policy rank in hybrid placement), not
the driver. The engine leaves a marker line for each thing it does, next to its own module
(tmp_path), so the test reads what happened in the worker process.

The smallest embedded-task run (the README's default model and data): one step of 4 prompts x 2
samples, no validation, no checkpoint, no plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ENGINE = '''
import inspect, json, os
from pathlib import Path

import ray

from polyrl.rollout.native.engine import NativeEngine

MARKERS = Path(__file__).parent / "markers.jsonl"


def mark(event):
    """One line per event: which process, which Ray actor, built from which polyrl worker module."""
    callers = sorted({Path(f.filename).name for f in inspect.stack() if "/polyrl/workers/" in f.filename})
    line = {"event": event, "pid": os.getpid(), "actor": ray.get_runtime_context().get_actor_id(),
            "workers": callers}
    with open(MARKERS, "a") as out:
        out.write(json.dumps(line) + "\\n")


class MarkedEngine(NativeEngine):
    """A user's engine: the built-in one, recording where it is built and where it generates."""

    def __init__(self, *args, **kwargs):
        mark("built")
        super().__init__(*args, **kwargs)

    @classmethod
    def from_model(cls, *args, **kwargs):
        mark("built from the policy")
        return super().from_model(*args, **kwargs)

    def generate_batch(self, *args, **kwargs):
        mark("generate_batch")
        return super().generate_batch(*args, **kwargs)
'''


def user_package(root: Path) -> Path:
    """my_engines/marked.py under `root` (what a user keeps beside their configs), installed as a
    distribution whose entry point names the engine `marked`."""
    package = root / "my_engines"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "marked.py").write_text(textwrap.dedent(ENGINE))
    info = root / "my_engines-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-engines\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[polyrl.rollout_backends]\nmarked = my_engines.marked:MarkedEngine\n")
    return package / "markers.jsonl"


def polyrl_train(root: Path, out: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    args = [sys.executable, "-m", "polyrl", "train",
            "data.train_batch_size=4", "rollout.n=2", "data.val_files=[]", "trainer.total_steps=1",
            "trainer.save_at_end=false", "logging.plot_at_end=false", "trainer.progress_bar=false",
            "actor.num_cpus_per_worker=1", "ray.address=local", f"trainer.output_dir={out}", *overrides]
    # the user's package is found through PYTHONPATH only (not the working directory)
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("backend,placement,worker", [
    ("my_engines.marked:MarkedEngine", "standalone", "rollout_worker.py"),  # by import path
    ("marked", "hybrid", "policy.py"),  # by entry point
])
def test_a_user_backend_trains_inside_the_ray_actor_hosting_rollout(tmp_path, backend, placement, worker):
    markers = user_package(tmp_path / "site")
    proc = polyrl_train(tmp_path / "site", tmp_path / "out", f"rollout.backend={backend}",
                        f"rollout.placement={placement}")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    events = [json.loads(line) for line in markers.read_text().splitlines()]
    built = [e for e in events if e["event"].startswith("built")]
    generated = [e for e in events if e["event"] == "generate_batch"]
    assert built and generated, events
    for event in built + generated:  # in a Ray actor's process, never the driver's
        assert event["actor"] is not None and event["pid"] != proc.pid, event
    assert all(worker in e["workers"] for e in built), built  # the worker module that hosts it
    assert {e["pid"] for e in generated} <= {e["pid"] for e in built}
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 1
