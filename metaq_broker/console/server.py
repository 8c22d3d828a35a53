"""The console's HTTP server: the pages (static files shipped in the package), and a JSON API the pages
poll (``/api/snapshot``, ``/api/history``, ``/api/messages``, ``/api/lookup``, ``/api/whoami``). Standard
library only; read-only but for logging in and out. Who may ask is access.py's: every request must name a Host the
console serves; with a SASL_SSL cluster every page and API needs a login, and a logged-in person's
answers come from clients acting as them (``UserViews``), so the brokers' ACLs decide what they see."""
from __future__ import annotations

import html
import json
import logging
import signal
import ssl
import sys
import threading
from dataclasses import replace
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Optional
from urllib.parse import parse_qs, urlsplit

from metaq_broker.console.access import (CSRF_COOKIE, SESSION_COOKIE, FormTokens, HostCheck, LoginLimiter, Session,
                                         Sessions, cookie, tokens_match)
from metaq_broker.console.collector import Clients, Collector, _error
from metaq_broker.errors import AuthenticationError, ConfigError, MetaqError
from metaq_broker.security.settings import ClientSecurity, private_key_warning

log = logging.getLogger(__name__)

PAGES = {"brokers": "Brokers", "topics": "Topics", "groups": "Consumer groups", "transactions": "Transactions",
         "messages": "Messages"}  # each is static/page.html with its name and title; app.js draws it
PUBLIC = {"style.css", "favicon.ico"}  # served without a login (and the login page): no data in them
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# Scripts only from our own files, no inline code: a message value that got into the markup still could
# not run.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
STOP_SECONDS = 5.0  # the bound on closing the clients at exit (ZooKeeper may be gone)
REQUEST_TIMEOUT_S = 30.0  # a connection's TLS handshake and each request line must arrive within this
MAX_CONNECTIONS = 64  # served at once; more are closed at once (a flood of idle connections holds no more)
MAX_FORM_BYTES = 16 << 10


def _static_files() -> dict:
    """{file name: bytes}: the static files, and ``<page>.html`` for each page."""
    root = resources.files("metaq_broker.console") / "static"
    files = {f.name: f.read_bytes() for f in root.iterdir() if f.is_file()}
    template = files.pop("page.html").decode()
    files.update({f"{page}.html": template.replace("{page}", page).replace("{title}", title).encode()
                  for page, title in PAGES.items()})
    return files


def tls_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """The console's HTTPS context (TLS 1.2 or later); ConfigError naming the files when they do not fit."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"--ssl-certfile {certfile} and --ssl-keyfile {keyfile} do not make a usable certificate "
                          f"and key ({getattr(e, 'reason', None) or e})") from None
    problem = private_key_warning("--ssl-keyfile", keyfile)
    if problem:
        log.warning("%s", problem)
    return ctx


def lost_login(snap: dict) -> bool:
    """The brokers stopped taking this person's login (password changed, user removed) since the last
    snapshot: their session ends."""
    errors = list(snap.get("errors", ())) + [b.get("error") or "" for b in snap.get("brokers", ())]
    return any("AuthenticationError" in e and "busy" not in e for e in errors)  # "busy": a flood, retried


class UserViews:
    """Per logged-in person, clients acting as them (their SASL login on every broker) and a sampler
    taking snapshots with those clients. Made at login (which the brokers check), closed when the person's
    last session ends. ``template`` is the console's ClientSecurity without a SASL user."""

    def __init__(self, zk_connect, zk_root, brokers, template: ClientSecurity, interval: float,
                 history_seconds: float):
        self.target, self.template = (zk_connect, zk_root, brokers), template
        self.interval, self.history_seconds = interval, history_seconds
        self._views: dict = {}  # user -> (Clients, Collector)
        self._lock = threading.Lock()

    def login(self, user: str, password: str) -> None:
        """Raises AuthenticationError (unknown user or wrong password), or another MetaqError (no broker)."""
        clients = Clients(*self.target, replace(self.template, sasl_username=user, sasl_password=password))
        try:
            admin = clients.admin()
            live = sorted(admin.cluster.brokers())
            if not live:
                raise MetaqError("no live broker to check the password with; try again once one is up")
            admin.connection(live[0]).session_token()  # the SASL login itself
        except BaseException:
            _close_later(clients)
            raise
        collector = Collector(clients, self.interval, self.history_seconds, as_user=True).start()
        with self._lock:
            old = self._views.get(user)
            self._views[user] = (clients, collector)
        if old is not None:  # logged in again (maybe with a new password): the new clients replace them
            _close_view(old)

    def collector(self, user: str) -> Optional[Collector]:
        with self._lock:
            view = self._views.get(user)
        return view[1] if view else None

    def close(self, user: str) -> None:
        with self._lock:
            view = self._views.pop(user, None)
        if view is not None:
            _close_view(view)

    def close_all(self) -> None:
        with self._lock:
            views, self._views = list(self._views.values()), {}
        for view in views:
            _close_view(view)


def _close_view(view) -> None:
    clients, collector = view
    collector.stop(timeout=0)
    _close_later(clients)


def _close_later(clients: Clients) -> None:
    threading.Thread(target=clients.close, name="metaq-console-close", daemon=True).start()


class ConsoleServer(ThreadingHTTPServer):
    """``collector`` serves everyone (no login); ``views`` serves logged-in people (SASL_SSL clusters)."""

    daemon_threads = True  # a request stuck on a dead broker does not hold the exit
    allow_reuse_address = True

    def __init__(self, address, collector: Optional[Collector], hosts: HostCheck, views: Optional[UserViews] = None,
                 tls: Optional[ssl.SSLContext] = None):
        self.collector, self.views, self.hosts, self.tls = collector, views, hosts, tls
        self.sessions = Sessions(on_last=views.close if views is not None else lambda user: None)
        self.logins = LoginLimiter()
        self.form_tokens = FormTokens()
        self.files = _static_files()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, Handler)
        if tls is not None:  # handshakes in the request's thread, never in the accept loop
            self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    @property
    def login_required(self) -> bool:
        return self.views is not None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{'[' + host + ']' if ':' in host else host}:{port}/"

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: this one waits for nothing
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        log.debug("request from %s failed", client_address, exc_info=True)  # a failed handshake, a reset


class Handler(BaseHTTPRequestHandler):
    server: ConsoleServer
    server_version = "metaq-console"
    timeout = REQUEST_TIMEOUT_S

    def setup(self) -> None:
        super().setup()
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()

    def log_message(self, fmt, *args):  # quiet: stderr is the operator's terminal
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: int, body: bytes, ctype: str, headers=()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("Referrer-Policy", "same-origin")  # "no-referrer" would make forms send Origin: null
        if self.server.tls is not None:
            self.send_header("Strict-Transport-Security", "max-age=31536000")
        for key, value in headers:
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj, headers=()) -> None:
        self._send(status, json.dumps(obj, default=str, allow_nan=False).encode(), "application/json", headers)

    def _redirect(self, where: str, headers=()) -> None:
        self._send(HTTPStatus.SEE_OTHER, b"", "text/plain; charset=utf-8", (("Location", where), *headers))

    # -- who is asking ----------------------------------------------------------------------------------
    def _foreign_host(self) -> bool:
        """Answer (421, nothing else) a request whose Host is not one this console serves: a page of
        another site that rebound its name to this address gets nothing."""
        if self.server.hosts.allows(self.headers.get("Host")):
            return False
        host = (self.headers.get("Host") or "")[:100]
        self._send(HTTPStatus.MISDIRECTED_REQUEST, f"this console does not serve the host {host!r}; an operator "
                   f"adds a name with metaq console --allowed-hosts\n".encode(), "text/plain; charset=utf-8")
        return True

    def _cookie(self, name: str) -> Optional[str]:
        try:
            jar = SimpleCookie(self.headers.get("Cookie") or "")
        except CookieError:
            return None
        return jar[name].value if name in jar else None

    def _session(self) -> Optional[Session]:
        return self.server.sessions.get(self._cookie(SESSION_COOKIE))

    def _cross_site(self) -> bool:
        """A state-changing request that a page of another origin sent (its Origin names that site)."""
        origin = self.headers.get("Origin")
        return origin is not None and not self.server.hosts.same_origin(origin)

    # -- GET ----------------------------------------------------------------------------------------------
    def do_GET(self):  # noqa: N802 - http.server's name
        if self._foreign_host():
            return
        url = urlsplit(self.path)
        path = url.path
        try:
            session = None
            if self.server.login_required:
                if path == "/login":
                    return self._login_page()
                name = path.lstrip("/")[7:] if path.startswith("/static/") else path.lstrip("/")
                if name in PUBLIC:
                    return self._static(name)
                session = self._session()
                collector = self.server.views.collector(session.user) if session is not None else None
                if collector is None:
                    if path.startswith("/api/"):
                        return self._json(HTTPStatus.UNAUTHORIZED, {"error": "log in first", "login": "/login"})
                    return self._redirect("/login")
            else:
                collector = self.server.collector
            if path.startswith("/api/"):
                return self._api(path[5:], parse_qs(url.query), collector, session)
            name = "brokers.html" if path in ("/", "/index.html") else path.lstrip("/")
            if name.startswith("static/"):
                name = name[7:]
            elif name in PAGES:
                name += ".html"
            self._static(name)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:  # noqa: BLE001 - the page shows the error; the server keeps serving
            log.debug("request %s failed", self.path, exc_info=True)
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": _error(e)})

    do_HEAD = do_GET  # noqa: N815 - the same answers without their bodies (``_send``)

    def _static(self, name: str) -> None:
        body = self.server.files.get(name) if name != "login.html" else None
        if body is None:
            return self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8")
        ext = name[name.rfind("."):]
        self._send(HTTPStatus.OK, body, TYPES.get(ext, "application/octet-stream"))

    def _login_page(self, error: str = "", status: int = HTTPStatus.OK) -> None:
        """The login form with a fresh token, also set as a cookie the form's POST must bring back: a form
        another site posts here has neither. Nothing of the cluster is on it."""
        if status == HTTPStatus.OK and self._session() is not None:
            return self._redirect("/")
        token = self._cookie(CSRF_COOKIE)
        if not self.server.form_tokens.valid(token):  # kept while valid: a second tab's form still works
            token = self.server.form_tokens.issue()
        page = self.server.files["login.html"].decode().replace("{csrf}", token).replace(
            "{error}", f'<p class="error" id="login-error">{html.escape(error)}</p>' if error else "")
        self._send(status, page.encode(), TYPES[".html"],
                   (("Set-Cookie", cookie(CSRF_COOKIE, token, self.server.tls is not None, "/login")),))

    def _api(self, what: str, query: dict, collector: Collector, session: Optional[Session]) -> None:
        if what == "whoami":
            return self._json(HTTPStatus.OK, {"user": session.user, "csrf": session.csrf} if session else {"user": None})
        if what == "snapshot":
            snap = collector.latest()
            if session is not None and lost_login(snap):
                self.server.sessions.end_user(session.user)
                return self._json(HTTPStatus.UNAUTHORIZED, {"error": "the cluster no longer takes your login: log in "
                                                                     "again", "login": "/login"})
            return self._json(HTTPStatus.OK, snap)
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
            except Exception as e:  # noqa: BLE001 - e.g. an offset out of range, a broker down, an ACL
                return self._json(HTTPStatus.OK, {"error": _error(e)})
        if what == "lookup":
            arg = {k: v[-1] for k, v in query.items()}
            key, msg_id = arg.get("key"), arg.get("msg_id", "")
            if not arg.get("topic") or (key is None) == (msg_id == ""):
                return self._json(HTTPStatus.BAD_REQUEST, {"error": "give a topic and a key or a message id"})
            try:
                msg_id = int(msg_id) if msg_id != "" else None
                count = int(arg.get("count") or 50)
            except ValueError:
                return self._json(HTTPStatus.BAD_REQUEST, {"error": "message id and count must be whole numbers"})
            try:
                return self._json(HTTPStatus.OK, collector.find(arg["topic"], key, msg_id, arg.get("partition"),
                                                                count))
            except Exception as e:  # noqa: BLE001 - e.g. a topic without a key index, a broker down, an ACL
                return self._json(HTTPStatus.OK, {"error": _error(e)})
        self._json(HTTPStatus.NOT_FOUND, {"error": f"no API {what!r}"})

    # -- POST: logging in and out ---------------------------------------------------------------------------
    def do_POST(self):  # noqa: N802 - http.server's name
        if self._foreign_host():
            return
        path = urlsplit(self.path).path
        if not self.server.login_required or path not in ("/login", "/logout"):
            return self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"read-only\n", "text/plain; charset=utf-8")
        if self._cross_site():
            return self._send(HTTPStatus.FORBIDDEN, b"refused: sent by a page of another site\n",
                              "text/plain; charset=utf-8")
        try:
            length = int(self.headers.get("Content-Length") or -1)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_FORM_BYTES:
            return self._send(HTTPStatus.BAD_REQUEST, b"a form of at most 16 KiB, with its Content-Length\n",
                              "text/plain; charset=utf-8")
        form = {k: v[-1] for k, v in parse_qs(self.rfile.read(length).decode("utf-8", "replace")).items()}
        if path == "/logout":
            return self._logout(form)
        self._login(form)

    def _login(self, form: dict) -> None:
        secure = self.server.tls is not None
        token = self._cookie(CSRF_COOKIE)
        if not (self.server.form_tokens.valid(token) and tokens_match(form.get("csrf"), token)):
            return self._login_page("the form expired or was not this console's: try again", HTTPStatus.FORBIDDEN)
        address = self.client_address[0]
        if self.server.logins.blocked(address):
            return self._login_page("too many failed logins from this address: wait a minute",
                                    HTTPStatus.TOO_MANY_REQUESTS)
        user, password = form.get("user", "").strip(), form.get("password", "")
        if not user or not password:
            return self._login_page("give a user name and a password", HTTPStatus.UNAUTHORIZED)
        try:
            self.server.views.login(user, password)
        except AuthenticationError as e:
            self.server.logins.failed(address)
            log.info("console login of %r refused: %s", user, e)
            return self._login_page("unknown user or wrong password" if "wrong password" in str(e) else str(e),
                                    HTTPStatus.UNAUTHORIZED)
        except Exception as e:  # noqa: BLE001 - no broker, ZooKeeper away: said on the page
            return self._login_page(f"cannot log in now: {_error(e)}", HTTPStatus.SERVICE_UNAVAILABLE)
        session = self.server.sessions.create(user)
        log.info("console: %s logged in from %s", user, address)
        self._redirect("/", (("Set-Cookie", cookie(SESSION_COOKIE, session.token, secure)),
                             ("Set-Cookie", cookie(CSRF_COOKIE, "", secure, "/login", max_age=0))))

    def _logout(self, form: dict) -> None:
        session = self._session()
        if session is None or not tokens_match(form.get("csrf") or self.headers.get("X-CSRF-Token"), session.csrf):
            return self._send(HTTPStatus.FORBIDDEN, b"refused: not this session's form\n", "text/plain; charset=utf-8")
        self.server.sessions.end(session.token)
        self._redirect("/login", (("Set-Cookie", cookie(SESSION_COOKIE, "", self.server.tls is not None,
                                                        max_age=0)),))


class Console:
    """A console serving in background threads (``metaq console``, and the quickstart's beside its
    cluster): ``start`` prints nothing and returns once it listens; ``stop`` is bounded. ``login``: every
    person logs in as a SASL user of the cluster (``security`` is then the console's settings without a
    user: its CA, its mechanism) and sees what that user may see; else the console acts as ``security``'s
    principal for every visitor."""

    def __init__(self, zk_connect: Optional[str], zk_root: str, brokers: Optional[str], host: str = "127.0.0.1",
                 port: int = 8480, interval: float = 2.0, history_seconds: float = 600.0, security=None,
                 login: bool = False, allowed_hosts=(), ssl_certfile: Optional[str] = None,
                 ssl_keyfile: Optional[str] = None):
        tls = tls_context(ssl_certfile, ssl_keyfile) if ssl_certfile else None
        if login:
            self.clients, self.collector = None, None
            self.views = UserViews(zk_connect, zk_root, brokers, security, interval, history_seconds)
        else:
            self.clients = Clients(zk_connect, zk_root, brokers, security)
            self.collector = Collector(self.clients, interval, history_seconds)
            self.views = None
        self.target = f"brokers {brokers}" if brokers else f"ZooKeeper {zk_connect}, root {zk_root}"
        self.server = ConsoleServer((host, port), self.collector, HostCheck(host, allowed_hosts), self.views,
                                    tls)  # OSError when the port is taken
        self._serving = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                         name="metaq-console-http", daemon=True)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> "Console":
        if self.collector is not None:
            self.collector.start()
        self._serving.start()
        return self

    def stop(self) -> None:
        """Bounded also when ZooKeeper or the brokers are gone: the sampler and request threads are
        daemons, closing the clients is given STOP_SECONDS."""
        self.server.shutdown()
        self.server.server_close()
        if self.views is not None:
            self.views.close_all()
            return
        self.collector.stop()
        closing = threading.Thread(target=self.clients.close, name="metaq-console-close", daemon=True)
        closing.start()
        closing.join(STOP_SECONDS)
        if closing.is_alive():
            log.warning("the console's ZooKeeper session did not close within %.0fs; leaving it", STOP_SECONDS)


def run(zk_connect: Optional[str], zk_root: str, brokers: Optional[str], host: str = "127.0.0.1", port: int = 8480,
        interval: float = 2.0, history_seconds: float = 600.0, out=print, security=None, login: bool = False,
        allowed_hosts=(), ssl_certfile: Optional[str] = None, ssl_keyfile: Optional[str] = None) -> int:
    """Serve the console until Ctrl-C or SIGTERM; returns 0."""
    # kazoo logs every failed reconnect at WARNING; the pages show ZooKeeper's state instead
    logging.getLogger("kazoo.client").setLevel(logging.ERROR)
    console = Console(zk_connect, zk_root, brokers, host, port, interval, history_seconds, security, login,
                      allowed_hosts, ssl_certfile, ssl_keyfile)
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        console.start()
        how = "each person logs in as a user of the cluster" if login else "no login"
        out(f"metaq console: {console.url} ({console.target}; {how}; Ctrl-C stops it)")
        if host in ("0.0.0.0", "::") and not allowed_hosts:
            out("metaq console: it answers requests for localhost, 127.0.0.1 and ::1 only; name the others it "
                "is reached by with --allowed-hosts")
        sys.stdout.flush()
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        console.stop()
    return 0
