"""The ``[metrics] listen`` endpoint: a small HTTP server thread in the supervisor.

It holds no figures of its own: each ``GET /metrics`` asks the router for its exposition text
over the frontend (a ``metrics`` request, the same one the gateway's ``GET /metrics`` sends) and for
its ``status``, from which the pod's gauges are rendered as the gateway renders them
(gateway/podgauges.py), so both endpoints show the same numbers from their one owner. See
docs/metrics.md.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from llamapool.client.errors import LlamapoolError
from llamapool.client.sync import Client
from llamapool.gateway.podgauges import CONTENT_TYPE, PodGauges


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], frontend: str, client_kw: dict[str, Any] | None = None,
                 vllm_names: bool = False):
        super().__init__(addr, _Handler)
        self.client = Client(frontend, **(client_kw or {}))  # client_kw: CURVE keys for a tcp:// frontend
        self.lock = threading.Lock()
        self.vllm_names = vllm_names

    def text(self) -> bytes:
        with self.lock:  # one scrape at a time through the one client
            text = self.client.metrics(timeout=5.0).encode()
            return text + PodGauges.from_status(self.client.status(timeout=5.0)).render(self.vllm_names)

    def shutdown(self) -> None:
        super().shutdown()
        self.server_close()
        self.client.close()


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer

    def do_GET(self) -> None:
        if self.path.split("?")[0] not in ("/metrics", "/"):
            self._send(404, "text/plain", b"not found: try /metrics\n")
            return
        try:
            body = self.server.text()
        except LlamapoolError as e:
            self._send(503, "text/plain", f"# llamapool unavailable: {e.message}\n".encode())
            return
        self._send(200, CONTENT_TYPE, body)

    def _send(self, status: int, ctype: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_metrics(addr: tuple[str, int], frontend: str, client_kw: dict[str, Any] | None = None,
                  vllm_names: bool = False) -> MetricsServer:
    """Bind now (an error here is a start-up error) and serve from a daemon thread."""
    server = MetricsServer(addr, frontend, client_kw, vllm_names)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
