"""Black-box agents: any program that talks to the OpenAI API, trained on the ids polyrl sampled.

    agent.black_box: my_pkg.agent:solve        # or /path/to/agent.py:solve
                                               # def solve(base_url, row, trajectory_id) -> ...

During rollout polyrl serves its rollout engine over the OpenAI-compatible API on 127.0.0.1 (one
server per engine, started on first use, polyrl/rollout/server) and calls the agent once per
sample with a base URL of its own (`http://127.0.0.1:PORT/trajectories/<id>/v1`), so the agent
needs nothing but `OpenAI(base_url=base_url, api_key="none")`. The server records each request's
prompt ids and the engine's `TokenOutput` under that id (trajectories.py). When the agent returns,
the turns are assembled into one training row:

    prompt   = the first turn's prompt ids
    response = turn 1's sampled ids (mask 1) + what turn 2's prompt adds (mask 0) + turn 2's
               sampled ids (mask 1) + ...

which requires every later prompt to *extend* the previous prompt + sampled ids. The server makes
an ordinary chat loop (append the reply, append the tool / user messages, ask again) extend by
construction; an agent that edits earlier messages or re-tokenizes text itself breaks the chain,
and its trajectory is kept for the group's statistics but gets no loss, counted in
`agent/prefix_mismatch`. An agent that raises, times out (`agent.black_box_timeout_s`), returns
something unusable or never calls the server gets no loss either, counted in `agent/env_errors`;
none of these stops training.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
import uuid
import weakref
from typing import Any, Callable, Sequence

from polyrl.agents.config import AgentConfig
from polyrl.agents.executor import _in_thread
from polyrl.agents.runner import eos_ids
from polyrl.agents.stats import AgentRollout, Trajectory, TrajectoryStats, to_rollout_batch
from polyrl.registry import PluginLoadError, load_plugin
from polyrl.rollout.base import SamplingParams

logger = logging.getLogger(__name__)


def load_agent(spec: str, environment_kwargs: dict[str, Any] | None = None) -> Callable[..., Any]:
    """"package.module:function" or "/path/to/file.py:function" -> the callable (errors name
    agent.black_box). A file is loaded once per process under a name derived from its path.
    "verifiers:TASKSET" is a verifiers environment loaded with `environment_kwargs`
    (polyrl/agents/verifiers_env.py)."""
    if spec.startswith("verifiers:"):
        from polyrl.agents.verifiers_env import agent_for

        return agent_for(spec, environment_kwargs or {})
    try:
        fn = load_plugin(spec, "polyrl_user_agent_")
    except PluginLoadError as exc:
        if exc.stage == "raised":  # the user's module failed while imported: its own error
            raise exc.cause from None  # type: ignore[misc]
        raise ValueError(f"agent.black_box '{spec}': cannot import it ({exc.cause or exc})") from None
    if not callable(fn):
        raise ValueError(f"agent.black_box '{spec}' is not callable")
    return fn


class BlackBoxServer:
    """The OpenAI API over one engine, with a trajectory recorder, on 127.0.0.1 (a free port)."""

    def __init__(self, engine: Any, tokenizer: Any):
        from polyrl.agents.chat import ChatDelta
        from polyrl.rollout.server.app import build_app
        from polyrl.rollout.server.http import HTTPServer
        from polyrl.rollout.server.trajectories import TrajectoryRecorder

        # the chat template's deltas make an ordinary chat loop extend its previous turn exactly
        continuation = ChatDelta(tokenizer) if getattr(tokenizer, "chat_template", None) else None
        self.recorder = TrajectoryRecorder(continuation)
        self.http = HTTPServer(build_app(engine, "policy", recorder=self.recorder)).start_in_thread()

    def base_url(self, trajectory_id: str) -> str:
        return f"{self.http.url}/trajectories/{trajectory_id}/v1"

    def stop(self) -> None:
        self.http.stop()


_servers: "weakref.WeakKeyDictionary[Any, BlackBoxServer]" = weakref.WeakKeyDictionary()
_servers_lock = threading.Lock()


def server_for(engine: Any, tokenizer: Any) -> BlackBoxServer:
    """The engine's server, started on first use and kept for the process's life (a rollout
    worker serves every step's agents from it)."""
    with _servers_lock:
        server = _servers.get(engine)
        if server is None:
            server = _servers[engine] = BlackBoxServer(engine, tokenizer)
        return server


def stop_servers() -> None:
    """Stop every black-box server of this process (tests; a worker's servers end with it)."""
    with _servers_lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        server.stop()


class BlackBoxRunner:
    """`sampling.n` agent runs per row, each under its own trajectory id; one RolloutBatch."""

    def __init__(self, engine: Any, tokenizer: Any, cfg: AgentConfig, agent: Callable[..., Any] | None = None):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.agent = agent if agent is not None else load_agent(cfg.black_box, cfg.environment_kwargs)
        self.server = server_for(engine, tokenizer)
        self.eos = eos_ids(engine, tokenizer)
        self._logged_error = False

    async def run(self, rows: Sequence[Any], sampling: SamplingParams, seeds: Sequence[int | None] | None = None,
                  group_offset: int = 0) -> AgentRollout:
        from polyrl.agents.runner import turn_seed

        sampling.validate()
        seeds = list(seeds) if seeds is not None else [sampling.seed] * len(rows)
        limit = asyncio.Semaphore(self.cfg.max_parallel_agents)
        run_id = uuid.uuid4().hex[:12]

        async def one(i: int, row: Any, sample: int) -> Trajectory:
            seed = seeds[i]
            async with limit:
                return await self.run_one(row, sampling, f"{run_id}-{group_offset + i}-{sample}",
                                          lambda turn: turn_seed(seed, sample, turn), group_offset + i)

        trajectories = list(await asyncio.gather(*(one(i, row, j) for i, row in enumerate(rows)
                                                   for j in range(sampling.n))))
        return AgentRollout(to_rollout_batch(trajectories, self.eos), trajectories)

    async def run_one(self, row: Any, sampling: SamplingParams, trajectory_id: str,
                      seeds: Callable[[int], int | None], group: int) -> Trajectory:
        recorder = self.server.recorder
        recorder.open(trajectory_id, sampling, seeds=seeds, max_turns=self.cfg.max_turns,
                      max_response_tokens=self.cfg.max_response_tokens)
        result, error = None, None
        try:
            result = await asyncio.wait_for(self._call(self.server.base_url(trajectory_id), row, trajectory_id),
                                            timeout=self.cfg.black_box_timeout_s)
        except asyncio.TimeoutError:
            error = f"did not return within agent.black_box_timeout_s={self.cfg.black_box_timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - the agent's failure is counted, never a crash
            error = f"raised {type(exc).__name__}: {exc}"
        finally:
            record = recorder.close(trajectory_id)  # later requests of an abandoned agent are refused
        # its engine calls still running are cancelled: wait until they left the engine, so a
        # colocated engine can sleep right after the rollout
        await asyncio.to_thread(record.idle.wait, 60.0)
        traj = assemble(record.turns, row, group, self.tokenizer)
        traj.stats.limit = record.limit
        if error is None:
            error = self._apply_result(traj, result)
        if error is None and not record.turns:
            error = "never called the server (it must send its requests to the base_url it is given)"
        if error is not None and record.limit is None:  # an agent ending on a limit is not an error
            self._count_error(traj, trajectory_id, error)
        if traj.stats.prefix_mismatch or (error is not None and record.limit is None):
            traj.loss_mask = [0.0] * len(traj.response_ids)
        return traj

    async def _call(self, base_url: str, row: Any, trajectory_id: str) -> Any:
        kwargs = {"base_url": base_url, "row": row, "trajectory_id": trajectory_id}
        if inspect.iscoroutinefunction(self.agent):
            return await _on_own_loop(self.agent, kwargs)
        # a blocking agent runs on its own thread (abandoned, not killed, on a timeout)
        result = await _in_thread(self.agent, kwargs)
        return await _on_own_loop(lambda: result, {}) if inspect.isawaitable(result) else result

    @staticmethod
    def _apply_result(traj: Trajectory, result: Any) -> str | None:
        """None: the reward function scores the last turn; a number: the reward; a string: the
        final answer to score. Anything else is the agent's error."""
        if result is None:
            return None
        if isinstance(result, (bool, int, float)):
            if not math.isfinite(result):  # an inf would turn its group's advantages into NaN
                return f"returned the reward {result!r}; a reward must be a finite number"
            traj.stats.reward = float(result)
            return None
        if isinstance(result, str):
            traj.final_text = result
            return None
        if isinstance(result, dict) and result:  # named terms (a rubric's weighted functions)
            bad = [k for k, v in result.items() if not isinstance(k, str) or isinstance(v, bool)
                   or not isinstance(v, (int, float)) or not math.isfinite(v)]
            if bad:
                return f"returned the reward terms {result!r}; each must be a name and a finite number"
            traj.stats.reward_terms = {k: float(v) for k, v in result.items()}
            traj.stats.reward = sum(traj.stats.reward_terms.values())
            return None
        return (f"returned {type(result).__name__}; return None, a number (the reward), a dict of named "
                "numbers (reward terms: their sum is the reward) or a string (the final answer)")

    def _count_error(self, traj: Trajectory, trajectory_id: str, error: str) -> None:
        traj.stats.env_errors += 1
        traj.stats.errors_by_kind["black_box"] = traj.stats.errors_by_kind.get("black_box", 0) + 1
        if not self._logged_error:  # once per rollout: the counter says how often
            self._logged_error = True
            logger.warning("black-box agent %s: trajectory %s %s (counted in agent/env_errors; "
                           "the trajectory gets no loss)", self.cfg.black_box, trajectory_id, error)


async def _on_own_loop(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """`await fn(**kwargs)` on an event loop of its own, in a thread of its own. An async agent that
    blocks its loop (a synchronous client or time.sleep inside `async def`) then cannot hold up the
    other agents or keep the rollout past `agent.black_box_timeout_s`: on the timeout its task is
    cancelled, and if it does not end, its thread is abandoned like a blocking agent's."""
    state: dict[str, Any] = {"cancelled": False}
    lock = threading.Lock()

    async def main() -> Any:
        with lock:
            if state["cancelled"]:
                raise asyncio.CancelledError
            state["loop"], state["task"] = asyncio.get_running_loop(), asyncio.current_task()
        return await fn(**kwargs)

    try:
        return await _in_thread(lambda: asyncio.run(main()), {})
    except asyncio.CancelledError:
        with lock:
            state["cancelled"] = True
            loop, task = state.get("loop"), state.get("task")
        if loop is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its loop already ended
                pass
        raise


def assemble(turns: Sequence[Any], row: Any, group: int, tokenizer: Any) -> Trajectory:
    """The recorded turns as one trajectory: each turn's sampled ids (mask 1) after what its
    prompt added to the previous prompt + sampled ids (mask 0). Stops at the first turn whose
    prompt does not extend them (`stats.prefix_mismatch`)."""
    stats = TrajectoryStats(environment="black_box")
    if not turns:
        return Trajectory(prompt_ids=list(row.prompt_ids), group=group, stats=stats, row=row)
    traj = Trajectory(prompt_ids=list(turns[0].prompt_ids), group=group, stats=stats, row=row)
    for k, turn in enumerate(turns):
        if k:
            context = traj.context
            if turn.prompt_ids[:len(context)] != context:
                stats.prefix_mismatch = 1
                break
            added = turn.prompt_ids[len(context):]
            # a token-id prompt names no messages: the samples log shows what its ids read
            messages = turn.added or ([{"role": "text", "content": tokenizer.decode(added)}] if added else [])
            traj.add_observation(added, messages)
        traj.add_turn(turn.output, tokenizer)
        stats.turns += 1
    return traj
