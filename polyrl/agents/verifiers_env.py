"""verifiers environments (`pip install 'polyrl[verifiers]'`, verifiers 0.4: its `verifiers.v1` API)
played as black-box agents against polyrl's own OpenAI-compatible endpoint.

    agent.environment: verifiers:my_taskset          # a verifiers taskset id (an importable package)
    agent.environment_kwargs:                        # the rest of verifiers' env config
      agent: {harness: {id: "null"}, runtime: {type: subprocess}}

    python -m polyrl.agents.verifiers_env my_taskset --out data/my_taskset.jsonl   # its tasks as rows

verifiers runs an episode as: its harness program (a chat loop, a coding agent, ...) talks to the
interception server verifiers starts, which forwards every model call to the client in the
episode's `ModelContext`; after the episode the task's `@vf.reward` functions and judges score the
trace. Here that client's base URL is the trajectory URL polyrl's black-box runner gives each
sample (polyrl/agents/black_box.py), so every model call is sampled by polyrl's engine and recorded
as token ids: the trajectory is assembled from those ids, token-exact like any black-box agent's.
The agent returns each reward function's (and judge's) weighted score by name: their sum is the
trajectory's reward, and each is logged as reward/<name>.

`agent.environment=verifiers:...` is turned into `agent.black_box` when the config is read
(config.py), so the black-box runner, its limits, timeouts and counters apply unchanged. The
environment is loaded once per process (the pre-flight loads it too: an unknown taskset is one
line before Ray), and its serving resources (the interception server, shared tool servers) live
on an event loop of their own for the process's life; each agent run submits its episode there.
A row names its task by `extra_info["verifiers_task"]` (the task's index in the taskset), which
is what `write_rows` / the command above writes.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import threading
from pathlib import Path
from typing import Any

PREFIX = "verifiers:"
TASK_KEY = "verifiers_task"
SUPPORTED = ">=0.4,<0.5"


def load_environment(name: str, kwargs: dict[str, Any]) -> Any:
    """The verifiers `Env` for taskset `name` with `kwargs` as the rest of its env config;
    ValueError of one line (naming agent.environment) when it cannot be built."""
    key = f"agent.environment={PREFIX}{name}"
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ValueError(f"{key} needs verifiers {SUPPORTED}: pip install 'polyrl[verifiers]' "
                         f"({type(exc).__name__}: {_one_line(exc)})") from None
    if not name:
        raise ValueError(f"{key} names no taskset: give verifiers:TASKSET_ID (an installed verifiers taskset)")
    config = dict(kwargs)
    config["taskset"] = {**(config.get("taskset") or {}), "id": name}
    try:
        return vf.load_environment(vf.resolve_env_config(config))
    except (ImportError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{key} cannot be loaded: {type(exc).__name__}: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


class VerifiersAgent:
    """The black-box agent for one verifiers environment: `agent(base_url, row, trajectory_id)`
    runs the row's task as one episode with the model at `base_url` and returns its reward."""

    def __init__(self, name: str, kwargs: dict[str, Any]):
        self.name = name
        self.env = load_environment(name, kwargs)
        self._tasks: dict[int, Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serving: Any = None
        self._lock = threading.Lock()

    def tasks(self) -> dict[int, Any]:
        if self._tasks is None:
            self._tasks = {task.data.idx: task for task in self.env.taskset}
        return self._tasks

    def _started(self) -> asyncio.AbstractEventLoop:
        """The loop the environment's serving resources live on, started on first use."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="verifiers-env", daemon=True).start()
                serving = self.env.serving()
                asyncio.run_coroutine_threadsafe(serving.__aenter__(), loop).result()
                self._loop, self._serving = loop, serving
                atexit.register(self.stop)
            return self._loop

    def __call__(self, base_url: str, row: Any, trajectory_id: str) -> dict[str, float]:
        task = self.tasks().get((getattr(row, "extra_info", None) or {}).get(TASK_KEY))
        if task is None:
            raise ValueError(f"the row's extra_info.{TASK_KEY} names no task of {self.name} "
                             f"(0..{len(self.tasks()) - 1}; write the rows with polyrl.agents.verifiers_env)")
        episode = asyncio.run_coroutine_threadsafe(self._episode(task, base_url), self._started()).result()
        if episode.errors or not episode.traces:
            raise RuntimeError(f"the {self.name} episode failed: " + "; ".join(
                f"{e.type}: {_one_line(Exception(e.message))}" for e in episode.errors))
        failed = [e for t in episode.traces for e in t.errors]
        if failed:
            raise RuntimeError(f"the {self.name} episode's agent failed: {failed[0].type}: "
                               f"{_one_line(Exception(failed[0].message))}")
        terms: dict[str, float] = {}  # each reward function's weighted score: reward/<name>
        for trace in episode.traces:
            for name, reward in trace.rewards.items():
                if reward is not None:
                    terms[name] = terms.get(name, 0.0) + reward.value
        return terms or {"reward": 0.0}

    async def _episode(self, task: Any, base_url: str) -> Any:
        from verifiers.v1.clients import EvalClientConfig, ModelContext

        # the trajectory URL is the whole endpoint: polyrl ignores the model name and the key
        ctx = ModelContext(model="policy", client=EvalClientConfig(base_url=base_url,
                                                                   api_key_var="POLYRL_TRAJECTORY_KEY"))
        return await self.env.run_episode(task, ctx)

    def stop(self) -> None:
        with self._lock:
            loop, serving, self._loop = self._loop, self._serving, None
        if loop is not None:
            asyncio.run_coroutine_threadsafe(serving.__aexit__(None, None, None), loop).result(60)
            loop.call_soon_threadsafe(loop.stop)


_agents: dict[tuple[str, str], VerifiersAgent] = {}
_agents_lock = threading.Lock()


def agent_for(spec: str, kwargs: dict[str, Any]) -> VerifiersAgent:
    """One agent per (environment, load arguments) and process: the environment loads once."""
    key = (spec, json.dumps(kwargs, sort_keys=True, default=str))
    with _agents_lock:
        if key not in _agents:
            _agents[key] = VerifiersAgent(spec[len(PREFIX):], kwargs)
        return _agents[key]


def write_rows(name: str, kwargs: dict[str, Any], out: Path, data_source: str = "verifiers") -> int:
    """The environment's tasks as polyrl data rows (verl schema, JSON lines): the task's prompt
    (its system prompt first), `extra_info.verifiers_task` = its index, and its `answer` field, when
    it has one, as the ground truth. Returns the number of rows."""
    env = load_environment(name, kwargs)
    lines = []
    for task in env.taskset:
        data = task.data
        prompt = data.prompt
        messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else
                    [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in prompt or []])
        if data.system_prompt:
            messages.insert(0, {"role": "system", "content": data.system_prompt})
        answer = getattr(data, "answer", None)
        lines.append(json.dumps({"data_source": data_source, "prompt": messages,
                                 "reward_model": {"ground_truth": None if answer is None else str(answer)},
                                 "extra_info": {TASK_KEY: data.idx}}))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return len(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a verifiers environment's tasks as polyrl data rows.")
    parser.add_argument("taskset", help="the verifiers taskset id (what follows verifiers: in agent.environment)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON-lines file to write")
    parser.add_argument("--env-config", default="{}", help="the rest of verifiers' env config, as JSON")
    parser.add_argument("--data-source", default="verifiers",
                        help="the rows' data_source (the reward function that scores failed episodes)")
    args = parser.parse_args(argv)
    n = write_rows(args.taskset, json.loads(args.env_config), args.out, args.data_source)
    print(f"wrote {n} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
