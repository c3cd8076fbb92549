"""The local verifier server of the reward.http tests (127.0.0.1 only)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class Verifier(ThreadingHTTPServer):
    """What the handler does is chosen per sample by extra_info["mode"]."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.release = threading.Event()  # hung handlers wait for it (set at teardown)
        self.bodies: list[dict] = []
        self.hits: dict[str, int] = {}
        self.lock = threading.Condition()
        self.in_flight = self.max_in_flight = self.arrivals = 0
        self.expected_arrivals = 0
        self.pair_up = 0  # "pair" mode: hold a request until this many are in flight

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"


class Handler(BaseHTTPRequestHandler):
    server: Verifier

    def log_message(self, *args):  # keep test output clean
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        srv = self.server
        mode = (body.get("extra_info") or {}).get("mode", "ok")
        with srv.lock:
            srv.bodies.append(body)
            key = f"{mode}:{body['solution_str']}"
            srv.hits[key] = srv.hits.get(key, 0) + 1
            hits = srv.hits[key]
        if mode == "hang":
            srv.release.wait()
            return self._send(200, {"score": 1.0})
        if mode == "500" or (mode == "flaky" and hits == 1):
            return self._send(500, "internal error")
        if mode == "400":
            return self._send(400, "bad request")
        if mode == "garbage":
            return self._send(200, "<html>not json</html>")
        if mode == "no-score":
            return self._send(200, {"result": 1.0})
        if mode == "pair":
            self._pair_up()
        score = float(body["solution_str"].strip() == str(body["ground_truth"]))
        return self._send(200, {"score": score, "tests_passed": 3.0 * score, "note": "text"})

    def _pair_up(self):
        """Wait until `pair_up` requests are in flight (or this is the last arrival): the most
        seen in flight at once is then exactly the client's concurrency limit."""
        srv = self.server
        with srv.lock:
            srv.in_flight += 1
            srv.arrivals += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
            srv.lock.notify_all()
            srv.lock.wait_for(lambda: srv.in_flight >= srv.pair_up or srv.arrivals == srv.expected_arrivals,
                              timeout=60)  # a deadline for a broken client, not an ordering sleep
            srv.in_flight -= 1

    def _send(self, status, payload):
        data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
        self.send_response(status)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    srv = Verifier()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.release.set()  # hung handlers return
    srv.shutdown()
    srv.server_close()
    thread.join()
