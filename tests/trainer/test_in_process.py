"""ray.enabled=false: the trainer, the policy worker and its engine in one process, no Ray
(polyrl/topology/in_process.py, docs/training.md "One process, no Ray").

The end-to-end test runs the same config twice, with Ray and in one process, and asserts the
same metrics and weights: the in-process run is the same code, not a second implementation.
Its process cannot import Ray at all (a blocked import), and lists its child processes after
every step, so "nothing is spawned" is observed, not assumed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from polyrl.job import JobConfig
from polyrl.topology.in_process import LocalActor, local_gather
from polyrl.topology.worker_group import WorkerGroup
from test_reproducible import final_weights, stable_metrics, start_train, wait_ok

# the in-process run's process: Ray cannot be imported, and after each step it records its
# child processes (a Ray run has raylet and gcs_server among them)
NO_RAY_DRIVER = r"""
import json, sys
class NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("Ray is blocked in this process (ray.enabled=false must not need it)")
sys.meta_path.insert(0, NoRay())
import psutil
from polyrl.trainer.loop import Trainer
seen, step = [], Trainer.train_step
def observed(self, n):
    out = step(self, n)
    seen.append(sorted(p.name() for p in psutil.Process().children(recursive=True)))
    return out
Trainer.train_step = observed
from polyrl.cli.main import main
rc = main(sys.argv[2:])
json.dump({"children": seen, "ray_imported": "ray" in sys.modules}, open(sys.argv[1], "w"))
sys.exit(rc)
"""


@pytest.mark.parametrize("overrides, key", [
    ({"actor": {"world_size": 2}}, "actor.world_size=2"),
    ({"rollout": {"placement": "disaggregated"}}, "rollout.placement=disaggregated"),
    # an earlier spelling is refused under the name it is now called
    ({"distill": {"teacher": "builtin:tiny-arith", "placement": "standalone"}},
     "distill.placement=disaggregated"),
    ({"reward": {"model": {"path": "builtin:tiny-arith"}}}, "reward.model"),
    ({"ray": {"address": "auto"}}, "ray.address=auto"),
])
def test_what_needs_a_second_process_is_refused_naming_the_key(overrides, key):
    data = {**overrides, "ray": {**overrides.get("ray", {}), "enabled": False}}
    with pytest.raises(ValueError) as info:
        JobConfig.model_validate(data)
    message = str(info.value)
    assert "ray.enabled=false" in message and key in message
    JobConfig.model_validate(overrides)  # with Ray (the default) the same settings are fine


def test_async_is_refused_too():
    """trainer.mode=async needs disaggregated placement, refused first by the topology check."""
    with pytest.raises(ValueError, match="placement"):
        JobConfig.model_validate({"trainer": {"mode": "async"}, "ray": {"enabled": False}})


class Drawer:
    """A worker that seeds itself once and draws from torch, numpy and Python random."""

    def setup(self, seed: int) -> None:
        torch.manual_seed(seed)

    def draw(self) -> float:
        return float(torch.rand(()))

    def shutdown(self) -> None:
        pass


def test_a_local_actor_keeps_its_own_random_state_as_a_process_would():
    group = WorkerGroup([LocalActor(Drawer())], ["drawer"], timeout_s=1, waiter=local_gather)
    group.call("setup", 3, phase="set-up")
    torch.manual_seed(99)  # the caller's state, and the caller drawing between calls
    caller = torch.rand(())
    got = [group.call("draw", phase="draw")[0] for _ in range(2)]
    torch.rand(5)
    got.append(group.call("draw", phase="draw")[0])
    torch.manual_seed(3)
    assert got == [float(x) for x in torch.rand(3)]  # what a separate process would have drawn
    torch.manual_seed(99)
    assert torch.equal(torch.rand(()), caller)
    group.shutdown()  # no process to end: Ray is not asked


def test_a_cuda_plan_in_process_has_no_ray_options_and_the_workers_device_is_cuda_0(monkeypatch):
    """What differs on a GPU, on a simulated H100: the in-process launch asks Ray for nothing
    (no options, no placement groups) while the plan still gives the rank device 0; the worker,
    with no Ray reservation, computes on cuda:0; the policy's planned variables are set for the
    run and the caller's come back; a LocalActor swaps the device module's random state too."""
    from polyrl.cli.common import choose_platform
    from polyrl.topology.base import plan_in_process
    from polyrl.topology.run_plan import resolve

    platform = choose_platform("h100")
    cfg = JobConfig.model_validate({"ray": {"enabled": False}, "rollout": {"max_model_len": 64},
                                    "platform": "cuda"})
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)  # the caller leaves it unset
    launch = plan_in_process(resolve(cfg, None, platform))
    try:
        (policy,) = launch.of("policy")
        assert launch.in_process and launch.options == {} and launch.placement is None
        assert policy.devices.ids == (0,) and policy.resources.get("num_gpus") == 1
        assert os.environ["TOKENIZERS_PARALLELISM"] == "false"  # as a Ray actor's runtime env
    finally:
        launch.release()
    assert "TOKENIZERS_PARALLELISM" not in os.environ
    assert platform.reserved_device() == torch.device("cuda", 0)
    actor = LocalActor(Drawer(), platform)
    assert actor.devices is torch.cuda  # its state is swapped once CUDA is initialised


@pytest.mark.slow
def test_one_process_matches_the_ray_run_and_starts_no_ray(tiny_model, arith_files, tmp_path):
    """Same config and seed with and without Ray: the same metrics, step for step, and the same
    final weights. The two runs overlap in time (2 cores)."""
    with_ray, alone = tmp_path / "ray", tmp_path / "alone"
    ray_run = start_train(with_ray, tiny_model, arith_files)
    args = [a for a in ray_run.args[3:] if a != "ray.address=local"] + ["ray.enabled=false"]
    probe = tmp_path / "probe.json"
    local_run = subprocess.Popen([sys.executable, "-c", NO_RAY_DRIVER, str(probe), *args[:1],
                                  *[a.replace(str(with_ray), str(alone)) for a in args[1:]]],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_ok(local_run)
    wait_ok(ray_run)
    seen = json.loads(probe.read_text())
    assert len(seen["children"]) == 3 and not seen["ray_imported"]
    assert not {"raylet", "gcs_server"} & {name for step in seen["children"] for name in step}, seen
    ours, theirs = stable_metrics(alone), stable_metrics(with_ray)
    assert len(ours) == 3 and ours == theirs
    a, b = final_weights(alone), final_weights(with_ray)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs between the Ray and the in-process run"


@pytest.mark.slow
def test_a_debugger_stops_inside_the_policy_worker(tmp_path):
    """`python -m pdb -m polyrl train ray.enabled=false`: a breakpoint in the worker's generate
    (which runs in a Ray actor otherwise) is hit in the same process, with the worker's state."""
    import inspect

    from polyrl.workers.policy import PolicyWorker

    lines, first = inspect.getsourcelines(PolicyWorker.generate)
    line = first + next(i for i, text in enumerate(lines) if "wake_up()" in text)
    commands = f"b polyrl/workers/policy.py:{line}\nc\np ('rank', self.rank, type(self).__name__)\nq\n"
    proc = subprocess.run([sys.executable, "-m", "pdb", "-m", "polyrl", "train", "ray.enabled=false",
                           "trainer.total_steps=1", "trainer.progress_bar=false", f"--output-dir={tmp_path}"],
                          input=commands, capture_output=True, text=True, timeout=300)
    assert f"policy.py({line})generate()" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "('rank', 0, 'PolicyWorker')" in proc.stdout
