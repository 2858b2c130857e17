"""The schedules client against a busy server: 503 is retried, other errors are not."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from tasks import schedules


def _server(statuses: list[int]):
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            code = statuses.pop(0) if statuses else 200
            body = json.dumps({"ok": True} if code == 200 else {"exception_message": "Service Unavailable"}).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, seen


def test_busy_server_is_retried_and_other_errors_are_not(monkeypatch):
    monkeypatch.setattr(schedules, "RETRY_DELAYS_S", (0.01, 0.01, 0.01))
    httpd, seen = _server([503, 503])
    api = f"http://127.0.0.1:{httpd.server_address[1]}/api"
    assert schedules.call(api, "GET", "/x") == {"ok": True} and len(seen) == 3
    httpd.shutdown()
    httpd, seen = _server([503] * 5)
    api = f"http://127.0.0.1:{httpd.server_address[1]}/api"
    with pytest.raises(schedules.ScheduleError, match="HTTP 503"):
        schedules.call(api, "GET", "/x")
    assert len(seen) == 4
    httpd.shutdown()
    httpd, seen = _server([404])
    api = f"http://127.0.0.1:{httpd.server_address[1]}/api"
    with pytest.raises(schedules.ScheduleError, match="HTTP 404"):
        schedules.call(api, "GET", "/x")
    assert len(seen) == 1
    httpd.shutdown()
