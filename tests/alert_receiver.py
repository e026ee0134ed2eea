"""A real HTTP server on loopback that records the alerts posted to it (the Slack webhook's stand-in)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class AlertReceiver:
    """Records every JSON body POSTed to it; ``stop()`` and ``start()`` take it down and up on the same port."""

    def __init__(self):
        self.received: list[dict] = []
        self.port = 0
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> "AlertReceiver":
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append(json.loads(body))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.allow_reuse_address = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/alerts"

    def texts(self) -> list[str]:
        return [r["text"] for r in self.received]
