"""Ctrl-C while `polyrl.train()` starts Ray leaves no Ray process behind, with real Ray.

The signal is sent at a fixed point inside `ray.init`: right after Ray spawned its head processes
(gcs_server, the monitor, log_monitor), before it recorded them
(`ray._private.node.Node.start_head_processes` returns, `Node.__init__` has not). `ray.shutdown()` alone does not know them there; `polyrl.api` ends them.
The run is a subprocess, so its children are its own and a test session's Ray is not involved."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    import psutil
    import ray._private.node as node
    import polyrl

    spawn = node.Node.start_head_processes

    def spawn_then_ctrl_c(self, *args, **kwargs):
        spawn(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)

    node.Node.start_head_processes = spawn_then_ctrl_c
    for attempt in range(2):  # a second call in the same process (a notebook) starts clean too
        try:
            polyrl.train(overrides={"trainer.output_dir": os.path.join(sys.argv[1], str(attempt)),
                                    "trainer.progress_bar": False})
            outcome = "finished"
        except polyrl.StartupInterrupted as exc:
            outcome = exc.exit_code
        left = []
        for p in psutil.Process().children(recursive=True):
            try:
                left.append(p.name() + " " + " ".join(p.cmdline())[:160])
            except psutil.Error:
                pass
        print("RESULT " + json.dumps({"outcome": outcome, "left": left}), flush=True)
""")


@pytest.mark.slow  # Ray's head processes started twice (~15 s on 2 busy cores)
def test_ctrl_c_inside_ray_init_leaves_no_ray_process(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert len(results) == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    for result in results:
        assert result["outcome"] == 130, result  # 128 + SIGINT
        assert result["left"] == [], result  # no gcs_server, raylet, monitor, dashboard, log_monitor, agent
