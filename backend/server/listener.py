"""The server's listening socket and its HTTP connections: bound before anything loads, and no
client may hold a connection by stalling.

``kvbaton serve`` binds its socket first (:func:`bind`, vLLM's ``create_server_socket`` pattern):
a taken port or an address the machine does not have fails at once, before the model loads, and
uvicorn (:func:`http_server`) then serves on that very socket, so nothing can take the port in between.

uvicorn's HTTP/1.1 protocol (h11) times out only idle keep-alive connections; a client that opens a
connection and sends nothing, part of its headers (slowloris) or its body a byte at a time, or that
stops reading a response (an unread stream), would hold the connection, and what its request holds
in the engine, forever. :class:`GuardedH11Protocol` gives each of these waits a deadline,
``client_timeout`` seconds:

- from a connection's (or request's) first byte until its headers are complete: else ``408`` and
  the connection is closed;
- between two reads of a request body: else the connection is closed (the app sees a disconnect);
- while the client takes no delivery of what the server sent: else the connection is aborted,
  which cancels the request (a stream's engine request is cancelled and what it made released, as
  for any client that goes away). Delivery is measured, not writes: the bytes written minus those
  still queued (the transport's buffer and, on Linux, the socket's send queue, ``SIOCOUTQ``) must
  grow within ``client_timeout`` while any are queued — a socket buffers megabytes, so an unread
  token stream would otherwise never pause the server's writes. (Where the send queue cannot be
  read, paused writes are the signal.)

A wait that is the server's own (reading paused because the app has not read the body yet) has no
deadline here. Invariant: the guard changes nothing for a client that keeps sending and reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import struct
import termios
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import h11
from kvbaton.errors import InvalidRequest
from uvicorn.protocols.http.h11_impl import H11Protocol

from .args import DEFAULTS
from .delivery import GONE

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_CLIENT_TIMEOUT_S", "GuardedH11Protocol", "bind", "bound_port", "check_client_timeout",
           "http_server"]
DEFAULT_CLIENT_TIMEOUT_S = DEFAULTS.client_timeout
MAX_HEADER_BYTES = 64 * 1024  # h11's buffer for an incomplete request head (its default is 16 KiB)
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this long (uvicorn's default)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free one); ``InvalidRequest`` naming the
    address when it cannot be bound (taken, or not this machine's)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidRequest(f"cannot bind {host}:{port}: {exc.strerror or exc}") from None
    family, _, proto, _, address = infos[0]
    # With its protocol (IPPROTO_TCP) named, asyncio sets TCP_NODELAY on every connection it accepts (it checks
    # ``sock.proto``); a socket made without gets none, and an answer's body, written after its head, would
    # wait for the client's delayed ACK: 40 ms on every request of a kept-alive connection.
    sock = socket.socket(family, socket.SOCK_STREAM, proto or socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may rebind at once (TIME_WAIT)
        sock.bind(address)
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError as exc:
        sock.close()
        raise InvalidRequest(f"cannot bind {host}:{port}: {exc.strerror or exc}") from None
    return sock


def bound_port(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


def http_server(app: Any, *, log_level: str, client_timeout: float = DEFAULT_CLIENT_TIMEOUT_S,
                on_exit: Callable[[], None] | None = None, **options: Any) -> uvicorn.Server:
    """The uvicorn server of ``app``, its connections guarded (:class:`GuardedH11Protocol`); run it
    with ``.run(sockets=[bind(...)])``. ``on_exit`` is called on SIGINT/SIGTERM before uvicorn's
    shutdown begins; ``options``: more ``uvicorn.Config`` settings."""
    import uvicorn

    protocol = type("KvbatonH11Protocol", (GuardedH11Protocol,), {"client_timeout": client_timeout})
    config = uvicorn.Config(  # asyncio's loop: its transports let the guard count what is written
        app, log_level=log_level, http=protocol, loop="asyncio", timeout_keep_alive=KEEP_ALIVE_S,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES, **options,
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if on_exit is not None:
                on_exit()
            super().handle_exit(sig, frame)

    return Server(config)


def check_client_timeout(seconds: float) -> None:
    if not seconds > 0:
        raise InvalidRequest(f"the client timeout must be > 0 seconds, got {seconds}")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on every wait for the client (see the module docstring)."""

    client_timeout: float = DEFAULT_CLIENT_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._tick: asyncio.TimerHandle | None = None
        self._written = 0  # bytes handed to the transport
        self._delivered = 0  # of them, no longer queued anywhere on this side (the peer acknowledged them)
        self._delivered_at = 0.0  # when delivery last progressed (or nothing was queued)

    def _arm(self, why: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.client_timeout, self._expired, why)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("headers")  # a connection that sends nothing at all is held to the same deadline
        write = transport.write

        def counted(data: Any) -> None:
            self._written += len(data)
            write(data)

        with contextlib.suppress(AttributeError):  # a transport that cannot be wrapped: paused writes are the signal
            transport.write = counted  # type: ignore[method-assign]
            self._delivered_at = time.monotonic()
            self._tick = self.loop.call_later(self._tick_s(), self._check_delivery)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not None and self.cycle is not cycle:  # a new request: the app can tell if its client left
            new = self.cycle
            new.scope[GONE] = lambda: bool(new.disconnected)  # type: ignore[typeddict-unknown-key]

    def _tick_s(self) -> float:
        return min(1.0, self.client_timeout / 4)

    def _queued(self) -> int:
        """Bytes written but not delivered: the transport's buffer and the socket's send queue."""
        queued = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):
                queued += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        return queued

    def _check_delivery(self) -> None:
        """Abort a connection whose queued bytes were not taken for ``client_timeout`` seconds."""
        self._tick = None
        if self.transport.is_closing():
            return
        now = time.monotonic()
        queued = self._queued()
        delivered = self._written - queued
        if queued == 0 or delivered > self._delivered:
            self._delivered, self._delivered_at = delivered, now
        elif now - self._delivered_at >= self.client_timeout:
            self._stalled("delivery")
            return
        self._tick = self.loop.call_later(self._tick_s(), self._check_delivery)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._rearm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._rearm()

    def _rearm(self) -> None:
        """Arm the deadline for what the connection waits for from the client now."""
        if self.transport.is_closing() or self.flow.write_paused:
            return  # the "reading" deadline runs until the client reads again
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._arm("body")  # restarted by every read: a limit on the pause between two
        elif state is h11.IDLE and (self.cycle is None or self.conn.trailing_data[0]):
            if self._deadline is None:  # a request head under way: its deadline runs from its first byte
                self._arm("headers")
        else:  # a whole request in hand, or idle between requests (uvicorn's keep-alive timeout then)
            self._disarm()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._arm("reading")  # the client does not read what the server sends

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm()
        self._rearm()

    def _expired(self, why: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if why == "body" and self.flow.read_paused:
            self._arm("body")  # the app has not read the body yet: the wait is the server's, not the client's
            return
        self._stalled(why)

    def _stalled(self, why: str) -> None:
        prefix = f"{self.client[0]}:{self.client[1]} - " if self.client else ""
        log.warning("%sclosing a connection that stalled for %g s (%s)", prefix, self.client_timeout,
                    {"headers": "request headers incomplete", "body": "request body stalled",
                     "reading": "the client does not read the response",
                     "delivery": "the client takes no delivery of the response"}[why])
        if why == "headers" and self.conn.our_state is h11.IDLE:
            with contextlib.suppress(h11.LocalProtocolError):
                body = b"request headers not received in time\n"
                headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close"),
                           (b"content-length", str(len(body)).encode())]
                self.transport.write(self.conn.send(h11.Response(status_code=408, headers=headers,
                                                                 reason=b"Request Timeout")))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            self.transport.close()
            return
        self.transport.abort()  # drops what is buffered: a paused write would otherwise wait on it forever
