"""HTTP servers that misbehave in front of a real one, for fault tests: FlakyProxy answers chosen requests with
an error status (or forwards them slowly), SilentServer accepts connections and never answers."""

import http.client
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class FlakyProxy:
    """An HTTP proxy in front of ``upstream`` that answers the first requests with ``failures`` (status codes, in
    order; a plain-text body as a gateway sends) and forwards every later one."""

    def __init__(self, upstream: str, failures: list[int], only: str = "", after: str = "", delay_s: float = 0.0):
        self.failures = list(failures)
        self.delay_s = delay_s  # each forwarded request waits this long first (a slow link)
        self.only = only  # fail only requests whose "METHOD path" holds this (all requests when empty)
        self.after = after  # and only once a request whose "METHOD path" holds this was forwarded
        self.answered: list[int] = []
        host = urlsplit(upstream)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                request = f"{self.command} {self.path}"
                if proxy.failures and proxy.only in request and not proxy.after:
                    status = proxy.failures.pop(0)
                    proxy.answered.append(status)
                    self.send_response(status)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", "9")
                    self.end_headers()
                    self.wfile.write(b"Forbidden")
                    return
                time.sleep(proxy.delay_s)
                conn = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                proxy.answered.append(resp.status)
                if proxy.after and proxy.after in request:
                    proxy.after = ""
                self.send_response(resp.status)
                self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _any

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


class SilentServer:
    """A TCP port that accepts connections (the kernel's backlog completes the handshake) and never answers: a
    server hung, or a gateway waiting on one. ``url``: http://127.0.0.1:<port>."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(512)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.sock.close()
