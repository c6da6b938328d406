"""The door: every HTTP request and WebSocket handshake proves who it is before any
route runs. A refused WebSocket handshake gets an HTTP answer (401, 403), never an
accepted socket. Routes then check the scope they need (``need``).

Two credentials: an ``Authorization: Bearer`` token, or the dashboard's session cookie
(``rota_session``, set by /ui/login, holding an admin token). A browser sends the cookie
by itself with any request, including one a foreign page makes it send, so a request
that changes state and proves itself only by the cookie must come from this origin
(``Sec-Fetch-Site: same-origin``, or an ``Origin`` naming this host), and with
``--ui-read-only`` it is refused outright.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import urlencode

import msgspec
from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Receive, Scope, Send

from rota.core.auth import Principal, bearer
from rota.server.coordinator import Coordinator
from rota.base.ids import uuid7
from rota.base.logs import printable
from rota.base.ojs import OJS_MEDIA, OJS_VERSION
from rota.core.ojs_map import error_body as ojs_error_body
from rota.core.policy import TokenBucket
from rota.core.settings import loopback

log = logging.getLogger("rota.server")
REFUSALS_LOGGED = 1.0  # refusal lines a second, on average (bursts of 10)
# Load balancers probe health without a token; the API's description is public.
OPEN_PATHS = frozenset({"/healthz", "/openapi.json", "/work.schema.json", "/ojs/manifest",
                        "/ojs/v1/health"})
COOKIE = "rota_session"
# A push endpoint's callbacks (rota/server/pushing.py) prove themselves by the per-attempt
# token in their body: an endpoint holds no bearer token.
CALLBACKS = ("/callback", "/callback/heartbeat")


def is_callback(path: str) -> bool:
    return path.startswith("/jobs/") and path.endswith(CALLBACKS) and path.count("/") <= 5
# The dashboard's pages that need no credential (the login form, its stylesheet), but
# whose requests still pass the Origin checks: a foreign page must not log a browser in.
UI_OPEN = frozenset({"/ui/login", "/ui/logout"})
STATIC = "/ui/static/"
UI_JOBS = "/ui/jobs/"  # a job's page and actions: the id is the rest of the path, "/" or not
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class Door:
    """Who a request is and whether it may come in, decided once for both ways in: the
    ASGI middleware below (``Gate``) and the HTTP protocol's direct routes
    (rota/server/direct.py), which share its refusal log's rate."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        # Refusals are logged at a bounded rate: a client retrying without a token, or
        # anyone at all, could otherwise write lines as fast as it connects.
        self._lines = TokenBucket(REFUSALS_LOGGED, 10)
        self._unlogged = 0

    def refused(self, fmt: str, *args: Any, level: int = logging.WARNING) -> None:
        if not self._lines.take(time.monotonic()):
            self._unlogged += 1
            return
        if self._unlogged:
            fmt += " (and %d more refusals not logged)"
            args = (*args, self._unlogged)
            self._unlogged = 0
        log.log(level, fmt, *args)

    async def check(self, scope: Scope) -> tuple[tuple[int, str, str] | None, dict[str, str]]:
        """The refusal (status, code, message), or None with the caller's principal set in
        the scope; and the headers as text, which the caller lets go of with its frame."""
        raw = scope["headers"]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
        repeated = len(headers) != len(raw)  # (before the cookie may add one)
        # The session cookie stands for a token on HTTP only: /work is for workers.
        if (scope["type"] == "http" and "authorization" not in headers
                and COOKIE in headers.get("cookie", "")):
            session = cookie_parser(headers["cookie"]).get(COOKIE)
            if session:
                headers["authorization"] = f"Bearer {session}"
                scope["rota.cookie"] = True
        if self.coordinator.tokens.unknown(headers.get("authorization")):
            await self.coordinator.reread_tokens()  # created a moment ago?
        return self._refusal(scope, headers, repeated=repeated), headers

    def _refusal(self, scope: Scope, headers: dict[str, str], *, repeated: bool = False
                 ) -> tuple[int, str, str] | None:
        settings = self.coordinator.settings
        if repeated:  # (a header this gate reads: which of two to believe?)
            for name, shown in ((b"authorization", "Authorization"), (b"host", "Host"),
                                (b"origin", "Origin")):
                if sum(1 for k, _ in scope["headers"] if k == name) > 1:
                    return 400, "duplicate_header", f"send one {shown} header"
        # Browsers send Origin (and Sec-Fetch-Site); workers and clients do not. A page
        # must not borrow a browser's network position to take jobs or give orders: a
        # plain-text POST needs no preflight, so without this any site could enqueue
        # jobs on a server that runs without tokens. The API's own origin is let in.
        origin = headers.get("origin")
        host = headers.get("host", "")
        if origin is not None and origin not in settings.allowed_origins and not (
                scope["type"] == "http" and origin in (f"http://{host}", f"https://{host}")):
            self.refused("refused %s origin=%r client=%s", scope["type"], origin, _client(scope))
            where = "on /work" if scope["type"] == "websocket" else "(--allowed-origin)"
            return 403, "origin_not_allowed", f"Origin {origin} is not allowed {where}"
        if headers.get("sec-fetch-site") == "cross-site" and origin not in settings.allowed_origins:
            self.refused("refused a cross-site %s request client=%s", scope["type"],
                          _client(scope))
            return 403, "origin_not_allowed", "cross-site requests are not allowed"
        if not self.coordinator.tokens.required and not _host_allowed(host, settings.host):
            # With no tokens, the only guard is that the server listens on loopback: a page
            # whose name is made to resolve to 127.0.0.1 (DNS rebinding) would get past
            # it, and its requests name that page's host.
            self.refused("refused %s host=%r client=%s: auth is off and the name is not"
                        " loopback", scope["type"], printable(host), _client(scope))
            return 403, "host_not_allowed", (f"Host {host!r} is not this server's name; with"
                                             " no tokens only loopback names are served")
        path = scope["path"]
        ui = path == "/ui" or path.startswith("/ui/")
        unsafe = scope["type"] == "http" and scope["method"] not in SAFE_METHODS
        if path in UI_OPEN or path.startswith(STATIC):
            principal = None  # no credential needed, nor checked
        else:
            principal = self.coordinator.tokens.authenticate(headers.get("authorization"))
            by_cookie = scope.get("rota.cookie", False)
            if principal is None or (by_cookie and principal.scope != "admin"):
                if _ui_page(scope, headers) and (by_cookie or "authorization" not in headers):
                    # A browser without a session is sent to the login form: every first
                    # visit does that, no warning. A cookie that stopped working (its
                    # token revoked) is worth an INFO line.
                    self.refused("sent %s %s to the login form client=%s%s", scope["method"],
                                  printable(path), _client(scope),
                                  ": its session cookie is not a valid admin token"
                                  if by_cookie else "",
                                  level=logging.INFO if by_cookie else logging.DEBUG)
                else:
                    self.refused("refused %s %s client=%s: no valid %s", scope["type"],
                                  printable(path), _client(scope),
                                  "session cookie" if by_cookie else "token")
                return 401, "unauthorized", unauthorized(headers.get("authorization"))
        raw_path = scope.get("raw_path") or b""
        if (b"%2F" in raw_path or b"%2f" in raw_path) and not path.startswith(UI_JOBS):
            return 404, "not_found", _names_nothing(
                path, "a job id holds no '/', encoded (%2F) or not",
                "no id or name holds a '/', encoded (%2F) or not")
        if (scope["type"] == "http" and not ui and path != "/"
                and (path.endswith("/") or "//" in path)):
            # An empty segment is an empty id or name ("rota jobs cancel $ID" with ID unset):
            # a JSON 404, not the router's redirect to the collection, which a client took
            # for an empty success.
            return 404, "not_found", _names_nothing(path, "a job id is never empty",
                                                    "no id or name is empty")
        if unsafe and (ui or scope.get("rota.cookie")):
            if not same_origin(headers):
                self.refused("refused %s %s client=%s: not from this origin", scope["method"],
                              printable(path), _client(scope))
                return 403, "cross_site", ("a browser's state-changing request must come from"
                                           " this server's own pages")
            if settings.ui_read_only and path not in UI_OPEN:
                return 403, "read_only", "the dashboard is read-only (--ui-read-only)"
        if principal is not None:
            scope["rota.principal"] = principal
        return None


class Gate:
    """Pure ASGI middleware: authenticate, check the WebSocket Origin, refuse early."""

    def __init__(self, app: ASGIApp, door: Door) -> None:
        self.app = app
        self.door = door

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS \
                or is_callback(scope["path"]):  # (its body's per-attempt token proves it)
            await self.app(scope, receive, send)
            return
        if await self._refused_at_door(scope, send):
            return
        await self.app(scope, receive, send)

    async def _refused_at_door(self, scope: Scope, send: Send) -> bool:
        """Whether the request was refused (and answered). Apart from ``__call__``, whose
        frame lives as long as a /work connection: the decoded headers die with this one
        (10,000 idle workers held 6 to 12 MiB of them when they were its locals)."""
        refusal, headers = await self.door.check(scope)
        if refusal is not None:
            if refusal[0] == 401 and _ui_page(scope, headers):
                await to_login(scope, send)  # a person, not a script: show the form
                return True
            await deny(scope, send, *refusal)
            return True
        return False


def unauthorized(authorization: str | None) -> str:
    """Why a request is refused 401: no token, or the one given is none of this server's
    (a caller told to send a token when it sent one looks for the wrong mistake)."""
    if bearer(authorization) is None:
        return "send a token: 'Authorization: Bearer rota_...'"
    return ("the token given is not valid here: revoked, mistyped, or made by a server on"
            " another database")


def _names_nothing(path: str, job_rule: str, name_rule: str) -> str:
    """Why ``path`` names nothing, after the rule it broke (for a job id, or for any id
    or name). Two such paths: one that held an encoded slash (%2F), since the server
    decodes a path before it routes it and "%2F" would split a segment in two (GET
    /jobs/a%2Fresult would be the result of job "a"; no id or name holds a "/", and only
    the dashboard's job pages take one, for jobs stored by earlier versions: UI_JOBS);
    and one with an empty segment, which the router would redirect to the collection."""
    shown = printable(path, 200)
    if path.startswith("/jobs/"):
        return f"no job at {shown}: {job_rule}"
    return f"nothing at {shown}: {name_rule}"


def same_origin(headers: dict[str, str]) -> bool:
    """Whether a browser says the request comes from a page of this very server. Browsers
    set Sec-Fetch-Site themselves (no page can forge it); older ones only send Origin."""
    if "sec-fetch-site" in headers:
        return headers["sec-fetch-site"] == "same-origin"
    host = headers.get("host", "")
    return headers.get("origin") in (f"http://{host}", f"https://{host}")


def _ui_page(scope: Scope, headers: dict[str, str]) -> bool:
    """A page of the dashboard asked for, or a form of it posted by a browser (a session
    that ended in another tab): both are answered with the login form, not JSON."""
    return (scope["type"] == "http"
            and (scope["method"] in ("GET", "HEAD")
                 or headers.get("sec-fetch-mode") == "navigate")
            and (scope["path"] == "/ui" or scope["path"].startswith("/ui/")))


async def to_login(scope: Scope, send: Send) -> None:
    """Send a browser that has no valid session to the login form, and back after (to the
    page asked for; after a posted form, to the overview: the form is not sent again)."""
    target = "/ui"
    if scope["method"] in ("GET", "HEAD"):
        target = scope["path"] + ("?" + scope["query_string"].decode("latin-1")
                                  if scope["query_string"] else "")
    location = "/ui/login?" + urlencode({"next": target})
    await send({"type": "http.response.start", "status": 303,
                "headers": [(b"location", location.encode("latin-1")),
                            (b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


def principal_of(scope: Scope) -> Principal:
    principal: Principal = scope["rota.principal"]
    return principal


async def deny(scope: Scope, send: Send, status: int, code: str, message: str) -> None:
    """Answer with a JSON error; on a WebSocket handshake, as its HTTP response."""
    headers, body = denial(scope["path"], status, code, message)
    headers.append((b"content-length", str(len(body)).encode()))
    prefix = "websocket.http.response" if scope["type"] == "websocket" else "http.response"
    await send({"type": f"{prefix}.start", "status": status, "headers": headers})
    await send({"type": f"{prefix}.body", "body": body})


def denial(path: str, status: int, code: str, message: str
           ) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """A refusal at the door: its headers (but its length) and body, in Rota's shape or,
    under /ojs/, OJS's; for the ASGI gate and the protocol's direct routes alike."""
    body = error_body(code, message)
    headers = [(b"content-type", b"application/json")]
    if path.startswith("/ojs/"):  # the OJS binding's clients read its shape
        body, headers = ojs_denial(status, code, message)
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="rota"'))
    return headers, body


def ojs_denial(status: int, code: str, message: str
               ) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """A refusal on an /ojs/ path in OJS's shape (docs/ojs.md): its body and headers."""
    ojs_code = {401: "unauthenticated", 403: "permission_denied"}.get(status, code)
    kind = "auth_error" if status in (401, 403) else "validation_error"
    request_id = f"req_{uuid7()}"
    body = msgspec.json.encode(ojs_error_body(status, ojs_code, message, type=kind,
                                              request_id=request_id,
                                              details={"rota_code": code}))
    return body, [(b"content-type", OJS_MEDIA.encode()), (b"ojs-version", OJS_VERSION.encode()),
                  (b"x-request-id", request_id.encode())]


def error_body(code: str, message: str) -> bytes:
    """Rota's one error shape, for answers given outside the routes."""
    return msgspec.json.encode({"error": {"code": code, "message": message}})


def _client(scope: Scope) -> Any:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


def _host_allowed(host: str, bind: str) -> bool:
    """Whether a Host header may reach a server bound to ``bind`` while auth is off:
    any, if it listens beyond loopback (run so with --insecure); else only loopback names."""
    if not loopback(bind):
        return True
    name = _host_name(host)
    return name == bind or loopback(name)


def _host_name(host: str) -> str:
    """The name in a Host header, without its port: "a:80" is "a", "[::1]:80" is "::1"."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
