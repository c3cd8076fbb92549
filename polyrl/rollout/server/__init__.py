"""Serving rollout engines: a Ray server actor, an OpenAI-compatible HTTP API, and a client-side
router over several replicas. See docs/serving.md.

- `start_rollout_server(...)` / `start_rollout_servers(n, ...)` -> Ray actor handle(s) (`RolloutServer`): token-in / token-out
  `generate`, plus weight updates, sleep / wake-up, abort and health.
- `build_app(engine, model_name)` + `HTTPServer(app, host, port)`: /v1/completions,
  /v1/chat/completions, /v1/models, /health and the token-level /generate.
- `Router(replicas)`: least-in-flight, sticky sessions, failover with retries and `metrics()`.
- `TrajectoryRecorder` (trajectories.py): with `build_app(..., recorder=...)`, black-box agent
  trajectories under /trajectories/<id>/v1, each request's prompt and sampled ids recorded.
"""

from polyrl.rollout.server.actor import RolloutServer, start_rollout_server, start_rollout_servers
from polyrl.rollout.server.app import build_app
from polyrl.rollout.server.http import HTTPServer
from polyrl.rollout.server.replicas import HTTPReplica, RayReplica, ReplicaDown
from polyrl.rollout.server.router import NoHealthyReplica, Router
from polyrl.rollout.server.trajectories import TrajectoryLimit, TrajectoryRecorder

__all__ = [
    "HTTPReplica",
    "HTTPServer",
    "NoHealthyReplica",
    "RayReplica",
    "ReplicaDown",
    "RolloutServer",
    "Router",
    "TrajectoryLimit",
    "TrajectoryRecorder",
    "build_app",
    "start_rollout_server",
    "start_rollout_servers",
]
