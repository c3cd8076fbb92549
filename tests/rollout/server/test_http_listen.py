"""The server's socket listens from the moment its URL is known (polyrl/rollout/server/http.py):
a client that connects as soon as `polyrl serve` prints the URL waits in the backlog instead of
being refused while uvicorn is still starting (a judge's start-up check failed this way on a loaded
machine)."""

import socket

from polyrl.rollout.server.http import HTTPServer


async def _app(scope, receive, send):  # never reached: uvicorn is not started here
    raise AssertionError("not served")


def test_a_connection_before_uvicorn_starts_is_queued_not_refused():
    server = HTTPServer(_app, "127.0.0.1", 0)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5):
            pass  # refused (ConnectionRefusedError) when the socket was only bound
    finally:
        server._sock.close()
