"""`ray job submit` of `polyrl train` to a Ray head on 127.0.0.1 (docs/ray_jobs.md): the job runs
from its `--working-dir`, its logs stream back, the run directory holds the run, and every worker
of the job gets the environment plan `polyrl env --role job` prints.

The head is a real `ray start --head --block` with ports of its own and a temp dir of its own, so
it neither meets nor stops another Ray instance on this machine; the test ends it by signalling
its process group (never `ray stop`, which stops every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent  # the `ray` and `polyrl` of this interpreter
PORT_FLAGS = ("port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port",
              "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port",
              "node-manager-port", "object-manager-port")

JOB_CONFIG = """\
# the embedded task (polyrl/configs/embedded_default.yaml), two steps, no validation
model:
  path: builtin:tiny-arith
data:
  train_files: [builtin:arithmetic_train]
  val_files: []
  max_prompt_length: 32
  train_batch_size: 16
rollout:
  n: 8
  response_length: 6
trainer:
  total_steps: 2
  progress_bar: false
ray:
  address: auto        # join the job's cluster (docs/ray_jobs.md)
"""

ENV_DUMP = '''\
"""Ray's worker_process_setup_hook: record the environment each worker of the job starts with."""
import json
import os


def dump():
    path = os.path.join(os.environ["ENV_DUMP_DIR"], f"{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump(dict(os.environ), f)
'''


@dataclass
class Head:
    address: str
    """The job server (the dashboard), what `ray job submit --address` takes."""
    env: dict[str, str]
    """The environment of the head and of every `ray` client call: the same auth token."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head():
    root = Path(tempfile.mkdtemp(prefix="rayjob", dir="/tmp"))  # Ray's socket paths must stay short
    token = root / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        env.pop(name, None)
    ports = {flag: free_port() for flag in PORT_FLAGS}
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=2",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--disable-usage-stats",
         f"--object-store-memory={200 * 2**20}", f"--temp-dir={root / 'ray'}",
         *(f"--{flag}={port}" for flag, port in ports.items())],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    started = threading.Event()

    def drain():  # read every line, so the head never blocks on a full pipe
        for line in head.stdout:
            lines.append(line)
            if "Ray runtime started" in line:
                started.set()
        started.set()  # exited: the wait below ends and the check fails with the log

    threading.Thread(target=drain, daemon=True).start()
    try:
        assert started.wait(120) and head.poll() is None, "ray start failed:\n" + "".join(lines)
        yield Head(f"http://127.0.0.1:{ports['dashboard-port']}", env)
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # the head and everything it started (one session)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(root, ignore_errors=True)


def working_dir(tmp_path: Path) -> Path:
    wd = tmp_path / "job"
    wd.mkdir()
    (wd / "job.yaml").write_text(JOB_CONFIG)
    (wd / "env_dump.py").write_text(ENV_DUMP)
    return wd


def submit(head: Head, wd: Path, runtime_env: dict, entrypoint: str) -> subprocess.CompletedProcess:
    """`ray job submit` as a user types it; it streams the job's logs until the job ends."""
    env_file = wd.parent / "runtime_env.json"
    env_file.write_text(json.dumps(runtime_env))
    return subprocess.run(
        [str(BIN / "ray"), "job", "submit", f"--address={head.address}", f"--working-dir={wd}",
         f"--runtime-env={env_file}", "--", "sh", "-c", entrypoint],
        env=head.env, capture_output=True, text=True, timeout=280)


def test_polyrl_train_runs_as_a_ray_job(ray_head, tmp_path):
    """Also: a forwarded variable (HF_HUB_OFFLINE) in the job's runtime env needs no
    RAY_OVERRIDE_JOB_RUNTIME_ENV: polyrl's `ray.init(runtime_env=...)` leaves out what the job's
    runtime env already sets, which Ray refused to merge."""
    wd, out, dumps = working_dir(tmp_path), tmp_path / "runs" / "job", tmp_path / "env"
    dumps.mkdir()
    runtime_env = {
        "worker_process_setup_hook": "env_dump.dump",
        # HF_* is forwarded by polyrl too: the driver leaves the job's own value to the job
        "env_vars": {"ENV_DUMP_DIR": str(dumps), "HF_HUB_OFFLINE": "1"},
    }
    plan_file = tmp_path / "job_plan.json"
    job = submit(ray_head, wd, runtime_env,
                 f"polyrl env --role job --json > {plan_file} && "
                 f"polyrl train -c job.yaml trainer.output_dir={out}")
    logs = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in logs, logs
    # the logs streamed back: the driver joined the head's cluster and trained
    assert "starting Ray (joining auto)" in logs and "policy: builtin:tiny-arith" in logs, logs
    unwrapped = "".join(logs.split())  # the log lines are wrapped to the terminal's width
    assert f"curves:{out}/curves.png" in unwrapped, logs  # where the run directory is
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["output_dir"] == str(out)
    assert (out / "config.yaml").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 2

    plan = {name: entry["value"] for name, entry in json.loads(plan_file.read_text()).items()}
    assert plan["TOKENIZERS_PARALLELISM"] == "false" and plan["HF_HUB_OFFLINE"] == "1", plan
    workers = [json.loads(p.read_text()) for p in dumps.glob("*.json")]
    assert workers, "no worker of the job ran the setup hook"
    for worker_env in workers:
        assert {name: worker_env.get(name) for name in plan} == plan


def test_without_ray_address_the_job_joins_its_cluster(ray_head, tmp_path):
    """With ray.address unset the job's RAY_ADDRESS is joined (a Ray of polyrl's own inside the job
    lacked the job's working_dir package: RuntimeEnvSetupError)."""
    wd, out = working_dir(tmp_path), tmp_path / "run"
    job = submit(ray_head, wd, {"env_vars": {"MY_JOB_TAG": "x"}},
                 f"polyrl train -c job.yaml ray.address=null trainer.output_dir={out}")
    logs = job.stdout + job.stderr
    assert job.returncode == 0 and "starting Ray (joining" in logs, logs
