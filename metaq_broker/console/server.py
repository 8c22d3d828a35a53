"""The console's HTTP server: the pages (static files shipped in the package), and a JSON API the pages
poll (``/api/snapshot``, ``/api/history``, ``/api/messages``). Standard library only; read-only (GET)."""
from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Optional
from urllib.parse import parse_qs, urlsplit

from metaq_broker.console.collector import Clients, Collector, _error

log = logging.getLogger(__name__)

PAGES = {"brokers": "Brokers", "topics": "Topics", "groups": "Consumer groups", "transactions": "Transactions",
         "messages": "Messages"}  # each is static/page.html with its name and title; app.js draws it
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# Scripts only from our own files, no inline code: a message value that got into the markup still could
# not run.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
STOP_SECONDS = 5.0  # the bound on closing the clients at exit (ZooKeeper may be gone)


def _static_files() -> dict:
    """{file name: bytes}: the static files, and ``<page>.html`` for each page."""
    root = resources.files("metaq_broker.console") / "static"
    files = {f.name: f.read_bytes() for f in root.iterdir() if f.is_file()}
    template = files.pop("page.html").decode()
    files.update({f"{page}.html": template.replace("{page}", page).replace("{title}", title).encode()
                  for page, title in PAGES.items()})
    return files


class ConsoleServer(ThreadingHTTPServer):
    daemon_threads = True  # a request stuck on a dead broker does not hold the exit
    allow_reuse_address = True

    def __init__(self, address, collector: Collector):
        self.collector = collector
        self.files = _static_files()
        super().__init__(address, Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}/"


class Handler(BaseHTTPRequestHandler):
    server: ConsoleServer
    server_version = "metaq-console"

    def log_message(self, fmt, *args):  # quiet: stderr is the operator's terminal
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", CSP)
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(obj, default=str, allow_nan=False).encode(), "application/json")

    def do_GET(self):  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        path = url.path
        try:
            if path.startswith("/api/"):
                return self._api(path[5:], parse_qs(url.query))
            name = "brokers.html" if path in ("/", "/index.html") else path.lstrip("/")
            if name.startswith("static/"):
                name = name[7:]
            elif name in PAGES:
                name += ".html"
            body = self.server.files.get(name)
            if body is None:
                return self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8")
            ext = name[name.rfind("."):]
            self._send(HTTPStatus.OK, body, TYPES.get(ext, "application/octet-stream"))
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:  # noqa: BLE001 - the page shows the error; the server keeps serving
            log.debug("request %s failed", self.path, exc_info=True)
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": _error(e)})

    def _api(self, what: str, query: dict) -> None:
        collector = self.server.collector
        if what == "snapshot":
            return self._json(HTTPStatus.OK, collector.latest())
        if what == "history":
            return self._json(HTTPStatus.OK, collector.series())
        if what == "messages":
            arg = {k: v[-1] for k, v in query.items()}
            if not arg.get("topic") or not arg.get("partition"):
                return self._json(HTTPStatus.BAD_REQUEST, {"error": "give topic and partition"})
            try:
                start = int(arg["from"]) if arg.get("from", "") != "" else None
                count = int(arg.get("count") or 50)
            except ValueError:
                return self._json(HTTPStatus.BAD_REQUEST, {"error": "from and count must be whole numbers"})
            try:
                return self._json(HTTPStatus.OK, collector.browse(arg["topic"], arg["partition"], start, count))
            except Exception as e:  # noqa: BLE001 - e.g. an offset out of range, a broker down
                return self._json(HTTPStatus.OK, {"error": _error(e)})
        self._json(HTTPStatus.NOT_FOUND, {"error": f"no API {what!r}"})

    def do_HEAD(self):  # noqa: N802
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"", "text/plain")


class Console:
    """A console serving in background threads (``metaq console``, and the quickstart's beside its
    cluster): ``start`` prints nothing and returns once it listens; ``stop`` is bounded."""

    def __init__(self, zk_connect: Optional[str], zk_root: str, brokers: Optional[str], host: str = "127.0.0.1",
                 port: int = 8480, interval: float = 2.0, history_seconds: float = 600.0, security=None):
        self.clients = Clients(zk_connect, zk_root, brokers, security)
        self.collector = Collector(self.clients, interval, history_seconds)
        self.server = ConsoleServer((host, port), self.collector)  # OSError when the port is taken
        self._serving = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                         name="metaq-console-http", daemon=True)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> "Console":
        self.collector.start()
        self._serving.start()
        return self

    def stop(self) -> None:
        """Bounded also when ZooKeeper or the brokers are gone: the sampler and request threads are
        daemons, closing the clients is given STOP_SECONDS."""
        self.server.shutdown()
        self.server.server_close()
        self.collector.stop()
        closing = threading.Thread(target=self.clients.close, name="metaq-console-close", daemon=True)
        closing.start()
        closing.join(STOP_SECONDS)
        if closing.is_alive():
            log.warning("the console's ZooKeeper session did not close within %.0fs; leaving it", STOP_SECONDS)


def run(zk_connect: Optional[str], zk_root: str, brokers: Optional[str], host: str = "127.0.0.1", port: int = 8480,
        interval: float = 2.0, history_seconds: float = 600.0, out=print, security=None) -> int:
    """Serve the console until Ctrl-C or SIGTERM; returns 0."""
    # kazoo logs every failed reconnect at WARNING; the pages show ZooKeeper's state instead
    logging.getLogger("kazoo.client").setLevel(logging.ERROR)
    console = Console(zk_connect, zk_root, brokers, host, port, interval, history_seconds, security)
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        console.start()
        out(f"metaq console: {console.url} ({console.clients.describe_target()}; Ctrl-C stops it)")
        sys.stdout.flush()
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        console.stop()
    return 0
