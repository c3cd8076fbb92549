"""Run an ASGI app with uvicorn: in the foreground (`polyrl serve`), in a background thread
(tests, notebooks), or as a task on an existing event loop (inside the Ray server actor).

The listening socket is bound and listening here, before uvicorn starts, so port 0 ("any free
port") works and the URL is known up front — no guess-a-free-port race — and a client that connects
as soon as the URL is printed waits in the backlog until uvicorn accepts, instead of being refused
while uvicorn is still starting (seen on a loaded machine).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import uvicorn


class HTTPServer:
    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning"):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
            self._sock.listen(2048)  # uvicorn's own backlog; it listens again on the same socket
        except (OSError, OverflowError) as exc:  # OverflowError: a port outside 0-65535
            self._sock.close()
            reason = getattr(exc, "strerror", None) or exc
            raise OSError(f"cannot listen on {host}:{port} ({reason}); "
                          f"choose another --port (0 picks a free one)") from None
        self.host, self.port = host, self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False,
                                                     timeout_graceful_shutdown=5))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serve in the foreground until SIGINT / SIGTERM (uvicorn handles both gracefully)."""
        self._server.run(sockets=[self._sock])

    async def serve(self) -> None:
        """Serve on the running event loop until `stop()`."""
        await self._server.serve(sockets=[self._sock])

    def start_in_thread(self, timeout_s: float = 30.0) -> "HTTPServer":
        """Serve from a daemon thread; returns once the server accepts connections."""
        self._thread = threading.Thread(target=self.run, name=f"http-{self.port}", daemon=True)
        self._thread.start()
        self.wait_started(timeout_s)
        return self

    def wait_started(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._server.started:
                return
            if self._thread is not None and not self._thread.is_alive():
                raise RuntimeError(f"HTTP server on {self.url} exited during start-up (see its log)")
            time.sleep(0.02)
        raise TimeoutError(f"HTTP server on {self.url} did not start within {timeout_s:.0f}s")

    async def wait_started_async(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._server.started:
                return
            await asyncio.sleep(0.02)
        raise TimeoutError(f"HTTP server on {self.url} did not start within {timeout_s:.0f}s")

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"HTTP server on {self.url} did not stop within {timeout_s:.0f}s")
        self._sock.close()
