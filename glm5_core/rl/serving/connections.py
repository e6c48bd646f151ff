"""Connection handling of the rollout server: a cap on connections served at once, a deadline on receiving
each whole request, and hang-up detection while a request runs (request bodies: ``json_http``).

* :class:`BoundedThreadingHTTPServer`: a thread per connection, at most ``max_connections`` at once; one past
  the cap gets ``503 Retry-After: 1`` from the accept loop itself (never blocking it) and is closed.
* :class:`DeadlineReader`: the handler's ``rfile``. A socket timeout bounds one ``recv``, so a client that
  trickles a byte every few seconds is never dropped by it; the reader also bounds the whole request (request
  line, headers and body) by ``request_deadline`` seconds from its first byte, and the wait for a request to
  begin by ``idle_timeout``. A stalled or trickling client is dropped, so slow clients cannot hold every slot.
* :func:`peer_closed`: whether the client hung up (readable with nothing to read), polled while its
  generation runs so the engine can stop it.
"""
from __future__ import annotations

import io
import json
import select
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Optional


def _busy_response(max_connections: int) -> bytes:
    body = json.dumps({"error": f"server busy: {max_connections} connections already being served"}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode("ascii") + body


class BoundedThreadingHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once."""

    daemon_threads = True
    block_on_close = False  # shutdown must not wait for idle keep-alive connections
    request_queue_size = 1024

    def __init__(self, address, handler_class, *, max_connections: int):
        self.max_connections = max_connections
        self.open_connections = 0  # served now (under _slots_lock)
        self.rejected_connections = 0  # written by the accept loop only
        self._slots_lock = threading.Lock()
        self._busy = _busy_response(max_connections)
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler_class)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def serve_in_background(self, name: str) -> threading.Thread:
        """Serve from a daemon thread named ``name`` (started, and returned)."""
        thread = threading.Thread(target=self.serve_forever, name=name, daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """Stop the accept loop serving on another thread and close the socket; handler threads are not waited
        for (``block_on_close`` is off)."""
        self.shutdown()
        self.server_close()

    def _take_slot(self) -> bool:
        with self._slots_lock:
            if self.open_connections >= self.max_connections:
                return False
            self.open_connections += 1
            return True

    def _free_slot(self) -> None:
        with self._slots_lock:
            self.open_connections -= 1

    def process_request(self, request, client_address):
        if not self._take_slot():
            self.rejected_connections += 1
            self._reject(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the handler thread
        except BaseException:
            self._free_slot()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._free_slot()

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], OSError):  # the client went away or stalled mid-reply: nothing to report
            return
        super().handle_error(request, client_address)

    def _reject(self, request: socket.socket) -> None:
        try:
            request.setblocking(False)  # a fresh socket's send buffer is empty: this never waits
            request.send(self._busy)
            request.recv(1 << 16)  # drop what already arrived, so closing sends FIN rather than RST
        except OSError:
            pass


class DeadlineReader(io.RawIOBase):
    """Raw reads from ``sock`` under two limits: ``idle_timeout`` until a request's first byte arrives, then
    ``request_deadline`` seconds for all of it. :meth:`begin_request` re-arms both, :meth:`end_request` lifts
    the deadline once the body is read (the reply may take as long as generation takes). A read past either
    limit raises ``TimeoutError``."""

    def __init__(self, sock: socket.socket, *, idle_timeout: float, request_deadline: float):
        super().__init__()
        self._sock = sock
        self._idle = idle_timeout
        self._window = request_deadline
        self._deadline: Optional[float] = None
        self._armed = True

    def readable(self) -> bool:
        return True

    def begin_request(self) -> None:
        self._deadline, self._armed = None, True

    def end_request(self) -> None:
        self._armed = False

    def readinto(self, buffer) -> int:
        if not self._armed:
            self._sock.settimeout(self._idle)
        elif self._deadline is None:
            self._sock.settimeout(self._idle)
        else:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"request not received within {self._window}s")
            self._sock.settimeout(min(left, self._idle))
        n = self._sock.recv_into(buffer)
        if n and self._armed and self._deadline is None:
            self._deadline = time.monotonic() + self._window  # the request began: its whole deadline runs now
        return n


def peer_closed(sock: socket.socket) -> bool:
    """True when the client closed its side (or reset the connection). Never blocks."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):  # reset, or the socket is already closed
        return True
