"""MCP tool servers as agent tools (agent.mcp_servers, polyrl/agents/mcp_tools.py), against the real
`mcp` SDK: a stdio calculator server written here with the SDK serves the bundled tiny-calc model
the same trajectories the Python tool does; tool errors and a dead server are `Error:` tool
results; a server that cannot start is one line before Ray."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest
from cli_runs import train_here  # noqa: F401  (a fixture)

pytest.importorskip("mcp")

REPO = Path(__file__).resolve().parents[2]
CALCULATOR_RECIPE = REPO / "configs" / "tools_calculator.yaml"

SERVER = textwrap.dedent('''
    """A calculator MCP server over stdio; each start appends its pid to the file in argv[1]."""
    import logging
    import os
    import sys

    from mcp.server.mcpserver import MCPServer

    from polyrl.agents.calculator import calculator as evaluate

    with open(sys.argv[1], "a") as starts:
        starts.write(f"{os.getpid()}\\n")
    server = MCPServer("calculator")


    @server.tool()
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression exactly."""
        return evaluate(expression)


    @server.tool()
    def fail(reason: str) -> str:
        """Always raises."""
        raise ValueError(reason)


    if len(sys.argv) > 2:  # a port: Streamable HTTP on 127.0.0.1
        server.run(transport="streamable-http", port=int(sys.argv[2]))
    else:
        logging.disable(logging.CRITICAL)  # the SDK logs a raising tool's traceback; the test reads results
        server.run()
''')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server command line and the file its starts are written to."""
    root = tmp_path_factory.mktemp("mcp")
    (root / "calc_server.py").write_text(SERVER)
    starts = root / "starts.txt"
    return f"{sys.executable} {root / 'calc_server.py'} {starts}", starts


def pids(starts: Path) -> list[int]:
    return [int(line) for line in starts.read_text().split()] if starts.exists() else []


def test_tools_errors_and_a_dead_server_are_tool_results(server):
    from polyrl.agents.executor import run_call
    from polyrl.agents.mcp_tools import McpHub
    from polyrl.agents.parsers import ToolCall
    import asyncio

    command, starts = server
    before = len(pids(starts))
    hub = McpHub([command], call_timeout_s=10.0, start_timeout_s=60.0)
    tools = hub.start()
    try:
        assert set(tools) == {"calculator", "fail"}
        schema = tools["calculator"].schema["function"]
        assert schema["parameters"]["properties"]["expression"]["type"] == "string"
        assert schema["parameters"]["required"] == ["expression"]

        def call(name, arguments):
            return asyncio.run(run_call(ToolCall(name, arguments), tools, 10.0, 64))

        assert call("calculator", {"expression": "1234*567"}).content == "699678"
        raised = call("fail", {"reason": "no such thing"})
        assert raised.error == "raised" and raised.content.startswith("Error: fail raised McpToolError")
        bad = call("calculator", {"expression": 3})  # checked against the server's schema first
        assert bad.error == "bad_arguments" and bad.content.startswith("Error: ")
        os.kill(pids(starts)[-1], signal.SIGKILL)  # the server dies mid-run
        for _ in range(2):  # no hang, no crash: each call is an error the model reads
            dead = call("calculator", {"expression": "2*3"})
            assert dead.error in ("raised", "timeout") and dead.content.startswith("Error: "), dead
            assert "MCP server" in dead.content and "calc_server.py" in dead.content, dead
    finally:
        hub.close()
    assert len(pids(starts)) == before + 1


def test_a_server_that_cannot_start_is_one_line_before_ray(train_here, tmp_path):
    from polyrl.agents.mcp_tools import check_servers

    missing = f"{sys.executable} {tmp_path / 'nope.py'}"
    with pytest.raises(ValueError, match=r"^agent.mcp_servers: '.*nope.py' failed to start: "):
        check_servers([missing], 30.0)
    with pytest.raises(ValueError, match="failed to start: FileNotFoundError"):
        check_servers(["no_such_mcp_command_here"], 30.0)
    out = train_here(f"model.path=builtin:tiny-calc", f"agent.mcp_servers=['{missing}']", "data.val_files=[]")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert "agent.mcp_servers: " in out.stderr and "failed to start" in out.stderr


@pytest.mark.slow
def test_a_streamable_http_server_serves_its_tools(server):
    import socket
    import subprocess
    import threading

    from polyrl.agents.mcp_tools import McpHub

    command, _ = server
    with socket.socket() as s:  # a free port for the server
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*command.split(), str(port)], stderr=subprocess.PIPE, text=True)
    try:
        ready = threading.Event()

        def watch():  # uvicorn says when it listens
            for line in proc.stderr:
                if "running on" in line.lower():
                    ready.set()

        threading.Thread(target=watch, daemon=True).start()
        assert ready.wait(60), proc.poll()
        hub = McpHub([f"http://127.0.0.1:{port}/mcp"], call_timeout_s=10.0, start_timeout_s=30.0)
        try:
            tools = hub.start()
            assert tools["calculator"](expression="99*99") == "9801"
            with pytest.raises(Exception, match="MCP|fail"):
                tools["fail"](reason="nope")
        finally:
            hub.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_tiny_calc_scores_the_same_through_mcp_as_through_the_python_tool(server):
    """The warm start sampled at T=1 on the same held-out prompts and seeds: the MCP server's
    results are the Python tool's, so the trajectories, and the accuracy, are the same."""
    from polyrl.agents import AgentConfig, run_trajectories_sync
    from polyrl.builtin import resolve
    from polyrl.config import load_config
    from polyrl.data import read_rows
    from polyrl.data.dataset import PromptSample
    from polyrl.job import JobConfig
    from polyrl.rewards.arithmetic import arithmetic_score
    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native.engine import NativeEngine
    from polyrl.training.model_loading import load_tokenizer

    command, _ = server
    cfg = load_config(JobConfig, files=[CALCULATOR_RECIPE])
    tokenizer = load_tokenizer(cfg.model.path)
    rows = []
    for i, r in enumerate(read_rows(resolve("builtin:calculator_val"))[:48]):
        text = tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        rows.append(PromptSample(i, r["data_source"], tokenizer(text, add_special_tokens=False)["input_ids"], text,
                                 r["prompt"], r["reward_model"]["ground_truth"], r["extra_info"]))
    engine = NativeEngine(resolve(cfg.model.path))
    sampling = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=cfg.rollout.response_length)
    python_tool = AgentConfig(**cfg.agent.model_dump())
    through_mcp = AgentConfig(**{**cfg.agent.model_dump(), "tools": [], "mcp_servers": [command]})
    outcomes = {}
    for name, agent in (("python", python_tool), ("mcp", through_mcp)):
        out = run_trajectories_sync(engine, tokenizer, rows, sampling, agent, seeds=list(range(len(rows))))
        right = [arithmetic_score(t, rows[i // 2].ground_truth, finished_with_eos=bool(e))
                 for i, (t, e) in enumerate(zip(out.batch.texts, out.batch.finished_with_eos.tolist()))]
        calls = sum(s.tool_calls for s in out.stats)
        errors = sum(s.tool_errors + s.tool_timeouts for s in out.stats)
        outcomes[name] = (out.batch.texts, sum(right) / len(right), calls, errors)
    assert outcomes["python"][2] > 0 and outcomes["python"][3] == 0
    assert outcomes["mcp"][1] == outcomes["python"][1] > 0, (outcomes["mcp"][1:], outcomes["python"][1:])
    assert outcomes["mcp"][2:] == outcomes["python"][2:]
    assert outcomes["mcp"][0] == outcomes["python"][0]


@pytest.mark.slow
def test_training_through_mcp_starts_the_server_once_per_worker(server, ray_session, tmp_path):
    """Two steps of the calculator recipe with the tool served over MCP: the rollout worker
    starts the server once for both steps (the pre-flight starts and stops one more), the model
    calls it, and the server exits when the run ends."""
    import psutil

    from polyrl.config import load_config
    from polyrl.job import JobConfig
    from polyrl.trainer.loop import Trainer

    command, starts = server
    before = len(pids(starts))
    cfg = load_config(JobConfig, files=[CALCULATOR_RECIPE], overrides=[
        "agent.tools=[]", f"agent.mcp_servers=['{command}']", "trainer.total_steps=2",
        "data.val_files=[]", "data.train_batch_size=8", "trainer.progress_bar=false",
        "logging.plot_at_end=false", f"trainer.output_dir={tmp_path}"])
    Trainer(cfg).fit()
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "agent/tool_calls_mean" in s]
    assert len(steps) == 2 and sum(s["agent/tool_calls_mean"] for s in steps) > 0
    assert all(s["agent/tool_errors"] == 0 and s["agent/tool_timeouts"] == 0 for s in steps), steps
    started = pids(starts)[before:]
    assert len(started) == 2, started  # the pre-flight's, then the rollout worker's, once
    for pid in started:
        try:
            psutil.Process(pid).wait(timeout=60)  # returns when the server has exited
        except psutil.NoSuchProcess:
            pass
