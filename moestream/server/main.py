"""The OpenAI-compatible HTTP server (`moestream serve`): bind, load, serve, stop.

The listening socket is bound first, so /health answers (503) while the engine loads on the
worker thread. SIGTERM or Ctrl+C stops accepting connections, lets running requests finish for
up to --shutdown-grace seconds, cancels what is left, closes the engine (its reader threads end),
and exits 0.
"""
from __future__ import annotations

import logging
import signal
import socket
import threading
from typing import Any, Callable

import uvicorn

from moestream.errors import MoestreamError
from moestream.server.app import DEFAULT_MAX_BODY_BYTES, RequestDefaults, create_app
from moestream.server.worker import Worker

log = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """Listen on host:port; a port in use or an address that cannot be had is a MoestreamError."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise MoestreamError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise MoestreamError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (is another server running "
                             "there? choose another --port)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(load_engine: Callable[[], Any], *, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
          model_id: str | None = None, max_queue: int | None = None,
          queue_tokens: int | None = None, parallel: int = 1, max_context: int | None = None,
          defaults: RequestDefaults | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          shutdown_grace: float = 10.0, log_level: str = "info",
          on_listening: Callable[[str], None] | None = None,
          speculation: Callable[[Any], Any] | None = None, reasoning_format: str = "auto") -> int:
    """Bind, start loading the engine, serve until SIGTERM/SIGINT, shut down cleanly; returns 0. A
    model that cannot load stops the server, then is a MoestreamError. speculation: engine ->
    SpeculativeOptions (Worker); max_queue, queue_tokens: the Worker's queue limits; reasoning_format:
    create_app's."""
    sock = bind_socket(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    worker = Worker(load_engine, max_queue=max_queue, queue_tokens=queue_tokens, parallel=parallel,
                    speculation=speculation)
    app = create_app(worker, api_key=api_key, model_id=model_id, max_body_bytes=max_body_bytes,
                     defaults=defaults, max_context=max_context, shutdown_timeout=max(1.0, shutdown_grace),
                     reasoning_format=reasoning_format)
    # the lifespan's end stops the worker, which closes the engine (its reader threads end)
    config = uvicorn.Config(app, host=bound_host, port=bound_port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_grace, log_config=None)
    server = _Server(config, on_exit=lambda: _cancel_later(worker, shutdown_grace))
    # a model that cannot load makes a server that can never answer: stop, and exit non-zero
    worker.on_load_failed = lambda message: setattr(server, "should_exit", True)
    worker.start()
    shown_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    url = f"http://{shown_host}:{bound_port}"
    if on_listening is not None:
        on_listening(url)
    # uvicorn re-raises the signal it caught once it has shut down; a handler that does nothing
    # absorbs it, so a requested stop exits 0 rather than dying of the signal.
    restore = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            restore[sig] = signal.signal(sig, _absorb_signal)
    try:
        server.run(sockets=[sock])
    finally:  # also where uvicorn stopped before its lifespan ended
        if not worker.shutdown(timeout=max(1.0, shutdown_grace)):
            log.warning("the engine did not stop in time; exiting anyway")
        sock.close()
        for sig, handler in restore.items():
            signal.signal(sig, handler)
    if worker.state == "failed":
        raise MoestreamError(worker.error)
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server, telling us once when a stop is asked for (SIGTERM, SIGINT)."""

    def __init__(self, config: uvicorn.Config, *, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._exit_seen = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if not self._exit_seen:
            self._exit_seen = True
            self._on_exit()


def _cancel_later(worker: Worker, grace: float) -> None:
    """Shortly before the grace period ends, cancel what still runs or waits, so those clients get
    an error event (or a 503) rather than a cut connection."""
    log.info("stopping: running requests have %.1f s to finish", grace)
    timer = threading.Timer(max(0.0, grace - 0.5), worker.shutdown, kwargs={"timeout": 1.0})
    timer.daemon = True
    timer.start()


def _absorb_signal(signum: int, frame: Any) -> None:
    log.debug("signal %d after shutdown ignored", signum)
