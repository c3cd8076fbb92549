"""What a user sees for bad input: one clear message naming the cause, exit code 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_runs import train_here  # noqa: F401  (a fixture)


def train(*args):
    """`polyrl train ARGS` as a user runs it, in a process of its own."""
    return subprocess.run([sys.executable, "-m", "polyrl", "train", "trainer.progress_bar=false", *args],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))


def assert_clean_error(out, *needles):
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    for needle in needles:
        assert needle in out.stderr, out.stderr


def test_missing_data_file(tiny_model, tmp_path):
    # a process of its own: the exit code and stderr a user's shell gets
    out = train(f"model.path={tiny_model}", f"data.train_files=[{tmp_path}/nope.parquet]",
                f"trainer.output_dir={tmp_path / 'out'}")
    assert_clean_error(out, "nope.parquet")


def test_missing_columns_are_named(train_here, tiny_model, tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["1+1="]}), path)
    out = train_here(f"model.path={tiny_model}", f"data.train_files=[{path}]", "data.val_files=[]")
    assert_clean_error(out, "prompt", "bad.parquet")


def test_corrupt_file(train_here, tiny_model, tmp_path):
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(b"not parquet at all")
    out = train_here(f"model.path={tiny_model}", f"data.train_files=[{path}]")
    assert_clean_error(out, "corrupt.parquet")


def test_missing_model_path(train_here, tmp_path):
    out = train_here(f"model.path={tmp_path}/no-model")
    assert_clean_error(out, "model.path", "no-model")


@pytest.mark.parametrize("override,needle", [
    ("rollout.n=1", "GRPO needs rollout.n >= 2"),
    ("algorithm.use_kl_loss=true", None),
    ("rollout.backend=vlm", "rollout.backend: 'vlm' is not one of native, vllm, sglang, trtllm"),
    ("rollout.backend=no_such_pkg.engine:Engine",  # a plugin by import path that is not there
     "rollout.backend: 'no_such_pkg.engine:Engine': no module 'no_such_pkg' here; put the directory"),
    ("actor.mini_batch_size=3", "actor.mini_batch_size=3 must divide data.train_batch_size=16"),
])
def test_contradictory_config(train_here, override, needle):
    if needle is None:  # both KL modes on at once
        out = train_here(override, "algorithm.use_kl_in_reward=true")
        assert_clean_error(out, "penalises KL twice")
    else:
        assert_clean_error(train_here(override), needle)


def test_engine_not_installed_names_the_extra(train_here, tiny_model):
    out = train_here(f"model.path={tiny_model}", "rollout.backend=vllm")
    assert_clean_error(out, 'pip install "polyrl[vllm]"')


def test_print_config_and_help_config(capsys):
    from polyrl.cli.main import main

    assert main(["train", "--print-config", "rollout.n=3"]) == 0
    assert "n: 3" in capsys.readouterr().out
    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "rollout.backend" in out and "Samples per prompt" in out


# --- pre-flight checks (polyrl/trainer/preflight.py), called directly ------------------------

def job_config(*overrides):
    from polyrl.config import load_config
    from polyrl.job import JobConfig

    return load_config(JobConfig, overrides=list(overrides))


def prompts(*lengths):
    from polyrl.data import PromptSample

    return [PromptSample(index=i, data_source="arithmetic", prompt_ids=[5] * n, prompt_text="x" * n,
                         raw_prompt="x" * n, ground_truth="1") for i, n in enumerate(lengths)]


def one_line_config_error(call, *needles):
    from polyrl.config import ConfigError

    with pytest.raises(ConfigError) as err:
        call()
    (problem,) = err.value.problems
    assert "\n" not in problem
    for needle in needles:
        assert needle in problem, problem
    return problem


def test_preflight_batch_larger_than_the_dataset():
    from polyrl.trainer.preflight import check_batch_sizes

    cfg = job_config("data.train_batch_size=8")
    one_line_config_error(lambda: check_batch_sizes(cfg, prompts(3, 3, 3), None),
                          "data.train_batch_size=8 is larger than the training set (3 prompts",
                          "at most 3")
    check_batch_sizes(job_config("data.train_batch_size=8", "data.drop_last=false"), prompts(3), None)
    one_line_config_error(lambda: check_batch_sizes(job_config("data.val_batch_size=4"), prompts(*[3] * 8),
                                                    prompts(3)), "data.val_batch_size=4")


def test_preflight_reward_function_that_cannot_be_imported(tmp_path):
    from polyrl.trainer.preflight import check_reward_function

    one_line_config_error(lambda: check_reward_function(job_config("reward.custom_function=no_such_mod:fn")),
                          "cannot import module 'no_such_mod'")
    broken = tmp_path / "broken.py"
    broken.write_text("import os\nraise RuntimeError('needs an API key')\n")
    one_line_config_error(lambda: check_reward_function(job_config(f"reward.custom_function={broken}:fn")),
                          "importing it raised RuntimeError: needs an API key", "broken.py, line 2")
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def fn(:\n")
    one_line_config_error(lambda: check_reward_function(job_config(f"reward.custom_function={syntax}:fn")),
                          "SyntaxError", "line 1")
    ok = tmp_path / "ok.py"
    ok.write_text("def fn(s, gt, extra=None):\n    return 0.0\n")
    check_reward_function(job_config(f"reward.custom_function={ok}:fn"))


def test_preflight_prompt_plus_response_longer_than_the_model_context():
    from types import SimpleNamespace

    from polyrl.trainer.preflight import check_model_context, longest_prompt

    cfg = job_config("rollout.response_length=100")
    longest = longest_prompt(prompts(10, 40), prompts(50))
    assert longest == 50
    one_line_config_error(lambda: check_model_context(cfg, longest, SimpleNamespace(max_position_embeddings=128)),
                          "50 tokens) + rollout.response_length=100 = 150 tokens exceeds the model's "
                          "context of 128", "at most 78")
    check_model_context(cfg, longest, SimpleNamespace(max_position_embeddings=150))
    check_model_context(cfg, longest, SimpleNamespace())  # the config does not say: nothing to check


def test_preflight_max_model_len_below_prompt_plus_response():
    from polyrl.trainer.preflight import check_max_model_len

    one_line_config_error(lambda: check_max_model_len(job_config("rollout.max_model_len=64",
                                                                 "rollout.response_length=60"), 10),
                          "rollout.max_model_len=64 is shorter than", "= 70", "rollout.max_model_len=70")
    check_max_model_len(job_config("rollout.response_length=60"), 10)  # unset: computed from the data


def test_preflight_platform_not_available_here():
    from polyrl.platform import get_platform
    from polyrl.trainer.preflight import check_platform

    if get_platform(None).name != "cpu":
        pytest.skip("this machine has an accelerator")
    one_line_config_error(lambda: check_platform(job_config("platform=cuda")),
                          "platform=cuda", "not available here")
    check_platform(job_config("platform=cpu"))


def test_check_job_runs_every_check_in_order(tmp_path):
    from types import SimpleNamespace

    from polyrl.trainer.preflight import check_job

    cfg = job_config("data.train_batch_size=2", "rollout.response_length=8", "rollout.n=2")
    check_job(cfg, prompts(4, 4), None, SimpleNamespace(max_position_embeddings=12))
    one_line_config_error(lambda: check_job(cfg, prompts(4, 5), None, SimpleNamespace(max_position_embeddings=12)),
                          "exceeds the model's context of 12")


def test_colocated_placement_with_a_collective_transport_is_refused():
    from polyrl.config import ConfigError

    for transport in ("broadcast", "object_store"):
        with pytest.raises(ConfigError, match=f"weights.transport={transport} has no receiver under "
                                              "rollout.placement=colocated"):
            job_config(f"weights.transport={transport}")
        job_config(f"weights.transport={transport}", "rollout.placement=disaggregated")


# --- a dead rank is named (polyrl/distributed/waits.py) ---------------------------------------

def test_gather_names_the_actor_that_died(ray_session):
    import ray

    from polyrl.distributed.waits import RemoteActorDied, gather

    @ray.remote(num_cpus=0)
    class Rank:
        def ok(self):
            return 1

        def die(self):
            os._exit(1)  # what an OOM kill or a segfault looks like to the driver

    alive, doomed = Rank.remote(), Rank.remote()
    assert gather([alive.ok.remote()], ["policy rank 0"], phase="update", timeout_s=60) == [1]
    with pytest.raises(RemoteActorDied) as err:
        gather([alive.ok.remote(), doomed.die.remote()], ["policy rank 0", "policy rank 1"],
               phase="update", timeout_s=60)
    assert err.value.actor == "policy rank 1" and err.value.phase == "update"
    message = str(err.value)
    assert message.startswith("update: policy rank 1 died (") and "\n" not in message
    ray.kill(alive)


# --- LoRA settings and resume mismatches: one line before Ray starts -------------------------
# (they used to surface inside a policy rank: a Ray traceback, exit 1)

def assert_refused_before_ray(out, *needles):
    assert_clean_error(out, *needles)
    assert "starting Ray" not in out.stderr, out.stderr
    assert len([line for line in out.stderr.splitlines() if "error:" in line]) == 1, out.stderr


@pytest.mark.parametrize("overrides,needle", [
    (["model.lora_target_modules=[qproj]"], "model.lora_target_modules: 'qproj' matches no linear layer"),
    (["model.lora_target_modules=[]"], "model.lora_target_modules: no linear layer to adapt"),
    (["model.lora_rank=100000"], "model.lora_rank=100000 is larger than layer(s)"),
])
def test_lora_settings_that_cannot_apply_are_refused_before_ray(train_here, tiny_model, overrides, needle):
    out = train_here(f"model.path={tiny_model}", "model.lora_rank=4", *overrides)
    assert_refused_before_ray(out, needle)


def checkpoint_written_by(out, *overrides):
    """A complete-looking checkpoint of step 1 whose config.yaml is the config `overrides`
    give: what the resume check reads on the driver (the engines' files are never reached)."""
    import torch
    import yaml

    from polyrl.cli.train import EMBEDDED_DEFAULT
    from polyrl.config import load_config
    from polyrl.job import JobConfig
    from polyrl.trainer.checkpoint import step_dir

    cfg = load_config(JobConfig, files=[str(EMBEDDED_DEFAULT)],
                      overrides=["trainer.progress_bar=false", f"trainer.output_dir={out}", *overrides])
    d = step_dir(out, 1)
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    torch.save({"step": 1}, d / "driver.pt")
    return d


@pytest.mark.parametrize("saved,now,needle", [
    # bug 7: then a FileNotFoundError (engine_rank0.pt) inside a policy rank
    (["actor.strategy=fsdp2"], ["actor.strategy=ddp"], "resume with actor.strategy=fsdp2"),
    # bug 8: then "loaded state dict contains a parameter group that doesn't match", exit 1
    (["model.lora_rank=4"], ["model.lora_rank=0"], "resume with model.lora_rank=4"),
    ([], ["model.lora_rank=4"], "holds a full-model policy (no LoRA), this run has model.lora_rank=4"),
    (["model.lora_rank=4"], ["model.lora_rank=8"], "resume with model.lora_rank=4"),
    (["model.lora_rank=4", "model.lora_target_modules=[q_proj]"], ["model.lora_rank=4"],
     "model.lora_target_modules=['q_proj'], this run has 'all-linear'"),
    (["model.lora_rank=4"], ["model.lora_rank=4", "actor.strategy=fsdp2"], "resume with actor.strategy=ddp"),
])
def test_a_checkpoint_the_engines_cannot_load_is_refused_before_ray(train_here, tiny_model, tmp_path,
                                                                    saved, now, needle):
    common = [f"model.path={tiny_model}"]
    ckpt = checkpoint_written_by(tmp_path / "out", *common, *saved)
    out = train_here(*common, *now)
    assert_refused_before_ray(out, "cannot resume", str(ckpt), needle, "trainer.resume=off")


def test_resume_compatibility_rules():
    from polyrl.trainer.checkpoint import CheckpointError, check_compatible

    def cfg(**flat):
        return {"actor": {"strategy": flat.get("strategy", "ddp"), "world_size": flat.get("ws", 1)},
                "model": {"lora_rank": flat.get("rank", 0), "lora_target_modules": "all-linear"}}

    # sharded checkpoints reshard: fsdp2 2 -> 1 and 1 -> 2, and a full-model ddp one -> fsdp2
    assert check_compatible(cfg(strategy="fsdp2", ws=2), cfg(strategy="fsdp2", ws=1)) == ["actor.world_size"]
    check_compatible(cfg(strategy="fsdp2", ws=1), cfg(strategy="fsdp2", ws=2))
    check_compatible(cfg(strategy="ddp"), cfg(strategy="fsdp2"))
    check_compatible(cfg(rank=8, strategy="fsdp2", ws=2), cfg(rank=8, strategy="fsdp2", ws=1))
    with pytest.raises(CheckpointError, match="actor.world_size: checkpoint has 2, this run has 1"):
        check_compatible(cfg(ws=2), cfg(ws=1))  # ddp: one optimizer file per rank
    with pytest.raises(CheckpointError, match="resume with actor.strategy=fsdp2"):
        check_compatible(cfg(strategy="fsdp2", ws=2), cfg(strategy="ddp", ws=2))


# --- ranks the machine cannot hold: refused before Ray starts --------------------------------
# (actor.world_size=64 on 2 cores warned, then spent minutes spawning 64 worker processes)

def test_more_ranks_than_a_local_run_can_place_are_refused_before_ray(train_here, tiny_model):
    from polyrl.trainer.preflight import MAX_RANKS_PER_CORE

    cores = os.cpu_count() or 1
    ranks = MAX_RANKS_PER_CORE * cores + 1
    out = train_here(f"model.path={tiny_model}", f"actor.world_size={ranks}",
                     f"data.train_batch_size={ranks}")
    assert_refused_before_ray(out, f"actor.world_size={ranks}: {ranks} policy ranks cannot be placed",
                              f"({cores} CPU cores, no GPUs)", "lower actor.world_size")


def test_placement_check_on_cpu_explicit_cpus_and_simulated_gpus():
    from polyrl.cli.common import choose_platform
    from polyrl.trainer.preflight import MAX_RANKS_PER_CORE, check_placement

    cores = os.cpu_count() or 1
    check_placement(job_config(f"actor.world_size={MAX_RANKS_PER_CORE * cores}",
                               f"data.train_batch_size={MAX_RANKS_PER_CORE * cores}"))
    one_line_config_error(lambda: check_placement(job_config(
        "rollout.placement=standalone", f"rollout.num_replicas={MAX_RANKS_PER_CORE * cores}")),
        f"1 policy + {MAX_RANKS_PER_CORE * cores} rollout ranks",
        "lower actor.world_size or rollout.num_replicas")
    one_line_config_error(lambda: check_placement(job_config("actor.world_size=2", "ray.num_cpus=1",
                                                             "actor.num_cpus_per_worker=1")),
                          "ray.num_cpus=1: the run's 2 ranks reserve 2 CPUs", "raise ray.num_cpus")
    one_line_config_error(lambda: check_placement(job_config(
        "ray.address=local", f"actor.world_size={cores + 1}", "actor.num_cpus_per_worker=1",
        f"data.train_batch_size={cores + 1}")),
        f"ray.address=local starts Ray with this machine's {cores} CPUs")
    # a cluster is checked once joined, not against this machine
    check_placement(job_config(f"actor.world_size={MAX_RANKS_PER_CORE * cores + 1}", "ray.address=auto",
                               f"data.train_batch_size={MAX_RANKS_PER_CORE * cores + 1}"))
    h100 = choose_platform("h100")  # a simulated node of 8 GPUs
    check_placement(job_config("actor.world_size=8", "data.train_batch_size=16"), h100)
    sixteen = job_config("actor.world_size=16", "data.train_batch_size=16")
    one_line_config_error(lambda: check_placement(sixteen, h100),
                          "the job needs 16 devices", "8 devices", "this machine: cuda")


def test_tool_that_cannot_load_fails_before_ray(capsys, caplog, tmp_path):
    """Tools are imported in pre-flight (polyrl.agents.preflight.check_agent): a tool file that
    raises on import is one line naming `agent.tools` and the file, before any actor starts."""
    tool = tmp_path / "my_tools.py"
    tool.write_text("import definitely_not_a_module\n\ndef lookup(q: str) -> str:\n    return q\n")
    from polyrl.cli.main import main

    code = main(["train", "-c", "configs/tools_calculator.yaml", "trainer.progress_bar=false",
                 f"trainer.output_dir={tmp_path / 'out'}", f"agent.tools=[{tool}:lookup]"])
    err = capsys.readouterr().err + caplog.text
    assert code == 2 and "Traceback" not in err, err
    assert "agent.tools" in err and "my_tools.py" in err, err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
