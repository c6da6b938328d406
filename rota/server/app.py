"""The Rota server: a Starlette app with /work and the HTTP API, served by uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import AsyncIterator, Iterator

import uvicorn
from uvicorn.server import STARTUP_FAILURE
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, WebSocketRoute

from rota.server import api_base, dashboard, ojs_base, routes
from rota.server.coordinator import Coordinator
from rota.server.gcsteward import Steward
from rota.server.edge import LeanWebSocket
from rota.server.httpedge import GuardedHttp
from rota.server.express import Express
from rota.server.gate import Door, Gate
from rota.server.ojs_api import ojs_app
from rota.server import ojs_flows  # cron and workflows under /ojs/v1
from rota.server.safety import SafetyNet
from rota.server.sessions import work_endpoint
from rota.core.settings import ServerSettings

log = logging.getLogger("rota.server")

# A worker frame larger than this is refused (close 1009) before it is decoded.
MAX_FRAME = 1 << 20


def create_app(settings: ServerSettings) -> Starlette:
    coordinator = Coordinator(settings)
    door = Door(coordinator)  # the gate's decisions, for the middleware and the direct routes

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        cluster = None
        if settings.database_url is not None:  # possibly one of several servers on it
            from rota.server.cluster import Cluster  # psycopg: only on PostgreSQL

            cluster = Cluster.of(coordinator, settings.database_url,
                                 url=f"{settings.host}:{settings.port}")
            coordinator.on_stop.append(cluster.let_go)
            app.state.cluster = cluster  # for tests and tools that look inside
            await cluster.listen()
        try:
            await coordinator.start()
        except BaseException:  # (no coordinator.stop() follows a failed start)
            if cluster is not None:
                await cluster.stop()
            raise
        if cluster is not None:
            cluster.start()
        try:
            yield
        finally:
            if cluster is not None:
                await cluster.stop()
            await coordinator.stop()

    app = Starlette(
        # /ojs first: its one prefix test spares each OJS request the regexes of every
        # other route (5% of a FETCH's CPU when it came after them).
        routes=[Mount("/ojs", ojs_app(coordinator, ojs_flows.routes)),
                *routes.routes, *dashboard.routes,
                WebSocketRoute("/work", work_endpoint),
                WebSocketRoute("/{path:path}", api_base.no_such_socket)],
        exception_handlers={**api_base.exception_handlers,  # type: ignore[arg-type]
                            HTTPException: no_route},
        # The net outermost: whatever escapes the routes or the gate still gets an answer.
        # Express, inside the gate: the producers' hot routes skip the router (express.py).
        middleware=[Middleware(SafetyNet), Middleware(Gate, door=door),
                    Middleware(Express, handlers=api_base.exception_handlers)],
        lifespan=lifespan,
    )
    app.state.coordinator = coordinator
    app.state.door = door
    return app


async def no_route(request: Request, exc: Exception) -> Response:
    """404/405 for a path no route matches: under /ojs/ in OJS's error shape (a path the
    mount's own routes cannot match, such as a job id holding a newline), else Rota's."""
    if request.url.path.startswith("/ojs/"):
        return await ojs_base.exception_handlers[HTTPException](request, exc)
    return await api_base.http_error(request, exc)


# Connections the kernel may hold before the server accepts them: a reconnect storm of
# 10,000 workers overflowed 2,048 (their SYNs dropped, retried a second or more later).
# The kernel caps it at net.core.somaxconn (4,096 here).
BACKLOG = 16384


def uvicorn_config(settings: ServerSettings, *, log_level: str = "info") -> uvicorn.Config:
    http = type("RotaHttp", (GuardedHttp,), {"header_timeout": settings.header_timeout})
    return uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=None,  # the CLI configures logging; uvicorn's access log stays quiet
        # uvicorn's own lines (connection open/closed) repeat what Rota logs better
        # (at Rota's debug too: only --log-level trace lets them through)
        log_level="trace" if log_level == "trace" else "warning",
        access_log=False,
        http=http,
        # websockets' sans-I/O protocol, lighter per idle connection
        ws=type("RotaWebSocket", (LeanWebSocket,),
                {"outbox_high_water": settings.outbox_high_water}),
        ws_max_size=MAX_FRAME,
        ws_per_message_deflate=False,
        ws_ping_interval=None,  # the heartbeat, not ping/pong, proves a worker alive
        lifespan="on",
        backlog=BACKLOG,
        limit_concurrency=settings.max_connections,  # above it, new connections get 503
        timeout_keep_alive=5,  # idle HTTP keep-alive connections are closed after this
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
    )


def listen_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A bound, listening TCP socket to hand to uvicorn (port 0 picks a free one).

    asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto is IPPROTO_TCP; a
    plain socket.socket() has proto 0, and then every second small frame in a row waits
    ~40 ms for a delayed ACK. Naming the protocol keeps pushes in the millisecond range.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        # Listening at once claims the port: with SO_REUSEADDR, another socket may bind a
        # port that is bound but not listening yet, listen first, and leave this one
        # failing later with EADDRINUSE (seen when the kernel handed port 0's pick to two
        # programs at once). uvicorn's own listen() only sets the backlog again.
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the program hosting it, and
    stops as soon as it is asked to (``request_exit``) rather than at its next tick, with
    no pause when no connection is open."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._exit = asyncio.Event()

    def request_exit(self, *, force: bool = False) -> None:
        self.should_exit = True
        self.force_exit = self.force_exit or force
        self._exit.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, but a TLS handshake gets ``--header-timeout`` (uvicorn leaves the
        loop's 60 s): a connection that never finishes one holds its slot no longer than
        one that never sends its headers. (Rota always hands over its sockets.)"""
        config = self.config
        timeout = getattr(config.http_protocol_class, "header_timeout", None)
        if config.ssl is None or sockets is None or timeout is None:
            await super().startup(sockets)
            return
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            raise SystemExit(STARTUP_FAILURE)

        def protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state,
                app_state=self.lifespan.state, _loop=_loop)

        loop = asyncio.get_running_loop()
        self.servers = [await loop.create_server(protocol, sock=sock, ssl=config.ssl,
                                                 backlog=config.backlog,
                                                 ssl_handshake_timeout=timeout)
                        for sock in sockets]
        self.started = True

    async def main_loop(self) -> None:
        # uvicorn's loop polls should_exit every 0.1 s; wake at once when asked instead.
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            try:
                await asyncio.wait_for(self._exit.wait(), timeout=0.1)
            except TimeoutError:
                pass

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn closes WebSockets before the lifespan ends: tell Rota first, so that
        # those closes are not taken for dead workers.
        coordinator = getattr(getattr(self.config.app, "state", None), "coordinator", None)
        if coordinator is not None:
            coordinator.begin_shutdown()
        if self.server_state.connections or self.server_state.tasks:
            await super().shutdown(sockets)  # graceful, as uvicorn does it
            return
        # Nothing is open: uvicorn would still pause 0.1 s for connections to wind down
        # (every stop of a test server paid it). Stop listening, then end the lifespan.
        for listener in self.servers:
            listener.close()
        for sock in sockets or []:
            sock.close()
        for listener in self.servers:
            await listener.wait_closed()
        if self.server_state.connections:  # one slipped in before the close: wind it down
            await super().shutdown(sockets)
        elif not self.force_exit:
            await self.lifespan.shutdown()


async def serve(settings: ServerSettings, *, log_level: str = "info",
                sock: socket.socket | None = None) -> None:
    """Serve until SIGINT or SIGTERM (graceful: connections close, writes commit); a
    second signal stops at once."""
    server = EmbeddedServer(uvicorn_config(settings, log_level=log_level))

    def on_signal() -> None:
        server.request_exit(force=server.should_exit)  # a second signal forces

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    if hasattr(signal, "SIGXFSZ"):
        # A write past the file-size limit (ulimit -f) would kill the process; ignored,
        # it fails with EFBIG, which SQLite reports as an I/O error: the store is
        # degraded and recovers when the limit is raised (docs/operations.md).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    scheme = "https" if settings.ssl_certfile else "http"
    log.info("serving on %s://%s:%d (workers connect to /work; the dashboard is at /ui%s)",
             scheme, settings.host, settings.port,
             ", read-only" if settings.ui_read_only else "")
    steward = Steward(loop, lambda: len(server.server_state.connections),
                      lambda: LeanWebSocket.closed)
    steward.start()
    looks = asyncio.create_task(_looking(steward), name="rota-gc-steward")
    try:
        await server.serve(sockets=[sock or listen_socket(settings.host, settings.port)])
    finally:
        looks.cancel()
        steward.stop()


async def _looking(steward: Steward, every: float = 10.0) -> None:
    while True:
        await asyncio.sleep(every)  # (a periodic check, not a synchronisation)
        steward.look()
