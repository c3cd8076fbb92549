"""OpenEnv environments (`openenv-core`, `pip install polyrl[openenv]`) as polyrl environments.

    agent.environment: openenv:http://127.0.0.1:8000          # a server that is already running
    agent.environment: openenv:my_pkg.server.app               # polyrl starts it (uvicorn, `app`)
    agent.environment: openenv:/path/to/server.py:app          # the same for a file

An OpenEnv environment is a server (FastAPI, `openenv.core.env_server.create_app`) whose
WebSocket (`/ws`) gives every connection a session of its own. Each trajectory here is one
`OpenEnvEnvironment`: it connects (one session), `reset`s with the row's arguments, then sends
every assistant turn as one `step` and appends the observation's text as a user turn; the
environment's reward and `done` end the episode like any polyrl environment's
(polyrl/agents/environments.py). It runs behind the runner's `_EnvAdapter`, so a server that times
out (`agent.tool_timeout_s`), dies mid-run or answers with an observation polyrl cannot read ends
that trajectory only, counted in agent/env_errors (docs/agents.md).

A module or file is served by one uvicorn process per rollout worker on a free port of 127.0.0.1,
started the first time a trajectory needs it and stopped with the worker (also when the worker is
killed: the child gets SIGTERM when its parent dies). A server process that died is started again
for the next trajectory.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

PREFIX = "openenv:"
URL_SCHEMES = ("http://", "https://", "ws://", "wss://")
SERVER_START_TIMEOUT_S = 120.0
"""How long a server process may take to answer /health (uvicorn imports the app: seconds on a
busy 2-core machine)."""


def is_url(target: str) -> bool:
    return target.startswith(URL_SCHEMES)


def split_app(target: str) -> tuple[str, str]:
    """"pkg.mod" / "pkg.mod:app" / "/path/server.py" / "/path/server.py:app" -> (module or file, app
    attribute)."""
    head, sep, attr = target.rpartition(":")
    if sep and attr.isidentifier() and head:
        return head, attr
    return target, "app"


def target_problem(target: str) -> str | None:
    """Why `target` (what follows "openenv:") cannot serve as an OpenEnv environment, one line; None
    when it can. Cheap: a URL must answer GET /health, a module must be findable (not imported),
    a file must exist."""
    if not target:
        return "names no server: give openenv:http://HOST:PORT or openenv:package.module (docs/agents.md)"
    if is_url(target):
        import httpx

        url = _http_url(target)
        try:
            httpx.get(f"{url}/health", timeout=5.0).raise_for_status()
        except Exception as exc:  # noqa: BLE001 - any failure is the one line the user reads
            return f"is not reachable: GET {url}/health failed ({type(exc).__name__}: {_one_line(exc)})"
        return None
    if importlib.util.find_spec("openenv") is None:
        return "needs openenv-core: pip install 'polyrl[openenv]'"
    module, _ = split_app(target)
    if module.endswith(".py") or "/" in module:
        if not Path(module).expanduser().is_file():
            return f"names the server file {module}, which does not exist"
        return None
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        found, why = None, f" ({_one_line(exc)})"
    else:
        why = ""
    if found is None:
        return (f"names the server module '{module}', which is not importable{why}: give an OpenEnv "
                "server module with a FastAPI `app` (package.module[:app] or /path/to/server.py[:app]) "
                "or an http(s):// URL")
    return None


def _one_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


def _http_url(url: str) -> str:
    url = url.rstrip("/")
    if url.startswith("ws://"):
        return "http://" + url[len("ws://"):]
    if url.startswith("wss://"):
        return "https://" + url[len("wss://"):]
    return url


def _die_with_parent() -> None:
    """In the server child before exec: SIGTERM when the rollout worker dies (Linux), so a killed
    worker leaves no server behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LocalServer:
    """One uvicorn process serving an OpenEnv app on 127.0.0.1; (re)started on demand."""

    def __init__(self, target: str):
        self.target = target
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self._lock = threading.Lock()

    def ensure(self) -> str:
        """The server's URL, starting it (again, after it died) when it is not running."""
        with self._lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            return self.url  # type: ignore[return-value]

    def _start(self) -> None:
        import httpx

        module, attr = split_app(self.target)
        cmd = [sys.executable, "-m", "uvicorn", "--host", "127.0.0.1", "--log-level", "warning"]
        if module.endswith(".py") or "/" in module:
            path = Path(module).expanduser().resolve()
            cmd += ["--app-dir", str(path.parent)]
            module = path.stem
        with socket.socket() as s:  # a free port; uvicorn binds it right after
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd += ["--port", str(port), f"{module}:{attr}"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, env=env, preexec_fn=_die_with_parent)
        _servers.append(self)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"the OpenEnv server '{self.target}' exited with {self.proc.returncode} "
                                   f"while starting: {' | '.join(err)}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # polling the child's port: it answers once uvicorn has bound it
        self.stop()
        raise RuntimeError(f"the OpenEnv server '{self.target}' did not answer {self.url}/health within "
                           f"{SERVER_START_TIMEOUT_S:g} s")

    def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


_servers: list[LocalServer] = []
_local: dict[str, LocalServer] = {}
_local_lock = threading.Lock()


@atexit.register
def stop_servers() -> None:
    """Stop every server this process started (tests; a worker's servers end with it)."""
    with _local_lock:
        servers = list(_servers)
        _servers.clear()
        _local.clear()
    for server in servers:
        server.stop()


class OpenEnvFactory:
    """What `ENVIRONMENTS.get("openenv:...")` returns: called with `agent.environment_kwargs` once
    per trajectory, it builds an `OpenEnvEnvironment` connected to the server."""

    def __init__(self, target: str):
        import openenv.core  # noqa: F401 - seconds on first import: here, not under the constructor's timeout

        self.target = target
        self.url = target
        if not is_url(target):
            with _local_lock:
                server = _local.setdefault(target, LocalServer(target))
            # started here, in the runner's `ENVIRONMENTS.get` (once per worker, again after the
            # process died), not in the constructor: that runs under agent.tool_timeout_s
            self.url = server.ensure()

    def __call__(self, **kwargs: Any) -> "OpenEnvEnvironment":
        return OpenEnvEnvironment(self.url, **kwargs)


def factory(name: str) -> OpenEnvFactory:
    return OpenEnvFactory(name[len(PREFIX):])


class OpenEnvEnvironment:
    """One OpenEnv session: `reset` per row, `step` per assistant turn (polyrl's `Environment`
    protocol; the runner calls each on a thread with `agent.tool_timeout_s`).

    agent.environment_kwargs:
        action_key: the action field that carries the assistant turn's text ("message")
        observation_key: the observation field read as the next user turn; null: "prompt", else
            the observation's only string field
        reset_key: the row's extra_info key whose dict is passed to reset (besides `seed`, the
            row's index) ("openenv_reset")
        timeout_s: seconds to connect or wait for one answer on the WebSocket (60)
    """

    def __init__(self, url: str, action_key: str = "message", observation_key: str | None = None,
                 reset_key: str = "openenv_reset", timeout_s: float = 60.0):
        from openenv.core import GenericEnvClient

        self.action_key, self.observation_key, self.reset_key = action_key, observation_key, reset_key
        self.client = GenericEnvClient(base_url=url, connect_timeout_s=timeout_s, message_timeout_s=timeout_s)
        self.client.connect()

    def reset(self, row: Any) -> str | None:
        extra = getattr(row, "extra_info", None) or {}
        kwargs = {"seed": getattr(row, "index", None), **(extra.get(self.reset_key) or {})}
        result = self.client.reset(**{k: v for k, v in kwargs.items() if v is not None})
        return self._text(result.observation, "reset") or None  # empty: the row's own prompt

    def step(self, action_text: str) -> Any:
        from polyrl.agents.environments import StepResult

        result = self.client.step({self.action_key: action_text})
        reward = 0.0 if result.reward is None else result.reward
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise TypeError(f"the OpenEnv step's reward must be a finite number, got {reward!r}")
        if not isinstance(result.done, bool):
            raise TypeError(f"the OpenEnv step's done must be a bool, got {result.done!r}")
        if result.done:
            return StepResult(None, float(reward), True)
        return StepResult(self._text(result.observation, "step"), float(reward), False)

    def _text(self, observation: Any, call: str) -> str:
        """The observation's text; TypeError (naming the fields it has) when there is none."""
        if not isinstance(observation, dict):
            raise TypeError(f"the OpenEnv {call} observation is {type(observation).__name__}, not an object")
        key = self.observation_key
        if key is None:
            strings = [k for k, v in observation.items() if isinstance(v, str)]
            key = "prompt" if "prompt" in strings else (strings[0] if len(strings) == 1 else None)
            if key is None:
                raise TypeError(f"the OpenEnv {call} observation has no single text field (fields: "
                                f"{_fields(observation)}); set agent.environment_kwargs.observation_key")
        value = observation.get(key)
        if not isinstance(value, str):
            raise TypeError(f"the OpenEnv {call} observation's '{key}' is {type(value).__name__}, not a "
                            f"string (fields: {_fields(observation)})")
        return value

    def close(self) -> None:
        # in the background: after a step that never answered, the WebSocket's closing handshake
        # waits on the same stuck session, and the trajectory is over either way
        threading.Thread(target=self.client.close, daemon=True).start()


def _fields(observation: dict) -> str:
    return json.dumps(sorted(observation))[:200]
