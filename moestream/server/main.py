"""`moestream serve`: the OpenAI-compatible HTTP server.

The listening socket is bound first, so /health answers (503) while the engine loads on the
worker thread. SIGTERM or Ctrl+C stops accepting connections, lets running requests finish for
up to --shutdown-grace seconds, cancels what is left, closes the engine (its reader threads end),
and exits 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any, Callable

import uvicorn

from moestream.cli_args import Parser, at_least, check_output_paths, finite_float, probability_mass
from moestream.errors import MoestreamError
from moestream.server.app import DEFAULT_MAX_BODY_BYTES, RequestDefaults, create_app
from moestream.server.worker import Worker

log = logging.getLogger(__name__)

API_KEY_ENV = "MOESTREAM_API_KEY"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be at least 0")
    return value


def build_parser(*, engine_arguments: bool = True) -> argparse.ArgumentParser:
    parser = Parser(
        prog="moestream serve",
        description="Serve a packed MoE model over the OpenAI HTTP API (/v1/chat/completions, /v1/completions, "
                    "/v1/models; also under /api/v1) with /health and /metrics. Up to --parallel requests generate "
                    "together (continuous batching); --max-queue more may wait.")
    parser.add_argument("--model", default=None,
                        help="packed model directory (default: the built-in demo model)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; 0.0.0.0 for other machines: put a TLS "
                             "proxy in front)")
    parser.add_argument("--port", type=_non_negative_int, default=8080, help="port (default 8080; 0 picks a free one)")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1 and /api/v1 (also ${API_KEY_ENV})")
    parser.add_argument("--parallel", type=at_least(1), default=1,
                        help="requests that generate together, each in its own sequence slot and KV cache, joining "
                             "and leaving the batch at step boundaries (default 1: one at a time)")
    parser.add_argument("--max-queue", "--queue-size", dest="max_queue", type=_non_negative_int, default=8,
                        help="requests that may wait beyond the --parallel running ones (default 8); beyond that, "
                             "503 with Retry-After")
    parser.add_argument("--model-id", default=None,
                        help="the id /v1/models advertises (default: the model's name); requests may name any model")
    defaults = RequestDefaults()
    parser.add_argument("--temperature", type=finite_float, default=defaults.temperature,
                        help=f"default temperature for requests without one (default {defaults.temperature})")
    parser.add_argument("--top-k", type=int, default=defaults.top_k,
                        help=f"default top-k (default {defaults.top_k}; 0 off)")
    parser.add_argument("--top-p", type=probability_mass, default=defaults.top_p,
                        help=f"default top-p (default {defaults.top_p})")
    parser.add_argument("--max-tokens", type=_positive_int, default=None,
                        help="default completion limit (default: the rest of the context)")
    parser.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
                        help=f"largest request body accepted, else 413 (default {DEFAULT_MAX_BODY_BYTES})")
    parser.add_argument("--shutdown-grace", type=float, default=10.0,
                        help="seconds running requests may take to finish after SIGTERM (default 10)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--timeline", metavar="FILE.json", default=None,
                        help="write a Chrome/Perfetto trace of everything the engine did while serving (host tracks: "
                             "steps, prefill chunks, expert loads, read waits, reads and copies, the decoder's segments), "
                             "written when the server stops")
    if engine_arguments:
        # the engine's flags (device, dtype, --max-context, prefill chunk, ...)
        from moestream.engine.options import add_engine_arguments
        from moestream.engine.speculative_flags import add_speculative_arguments
        add_speculative_arguments(parser)
        add_engine_arguments(parser)
    else:
        parser.add_argument("--max-context", type=int, default=0,
                            help="prompt plus completion limit in tokens (default: the engine's)")
    return parser


def defaults_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> RequestDefaults:
    parser = parser or build_parser(engine_arguments=False)
    if not 0.0 <= args.temperature <= 2.0:
        parser.error(f"argument --temperature: must be between 0 and 2, not {args.temperature}")
    return RequestDefaults(temperature=args.temperature, top_k=max(0, args.top_k), top_p=args.top_p,
                           max_tokens=args.max_tokens)


def api_key_from(args: argparse.Namespace, environ: dict | None = None) -> str | None:
    """--api-key, else $MOESTREAM_API_KEY (keeps the key off the command line), else none."""
    environ = os.environ if environ is None else environ
    return args.api_key or environ.get(API_KEY_ENV) or None


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
          model_id: str | None = None, max_queue: int = 8, parallel: int = 1, max_context: int | None = None,
          defaults: RequestDefaults | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          shutdown_grace: float = 10.0, log_level: str = "info",
          on_listening: Callable[[str], None] | None = None,
          speculation: Callable[[Any], Any] | None = None) -> int:
    """Bind, start loading the engine, serve until SIGTERM/SIGINT, shut down cleanly. Returns 0,
    or 1 when the model could not be loaded. speculation: engine -> SpeculativeOptions (Worker)."""
    sock = bind_socket(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    worker = Worker(load_engine, max_queue=max_queue, parallel=parallel, speculation=speculation)
    app = create_app(worker, api_key=api_key, model_id=model_id, max_body_bytes=max_body_bytes,
                     defaults=defaults, max_context=max_context, shutdown_timeout=max(1.0, shutdown_grace))
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
        print(f"moestream serve: {worker.error}", file=sys.stderr)
        return 1
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_output_paths(parser, args, {"trace_routing": "--trace-routing", "timeline": "--timeline"})
    from moestream.engine.speculative_flags import check_speculative_args, speculating, speculative_options

    # requests bring their own sampling settings
    check_speculative_args(parser, args, sampling=None, model_dir=args.model, batched=args.parallel > 1)
    defaults = defaults_from_args(args, parser)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from moestream.engine.options import EngineOptions

    options = EngineOptions.from_args(args)
    options.max_sequences = args.parallel  # a sequence slot (its own KV cache) per request running at once
    api_key = api_key_from(args)

    def load_engine():
        from moestream.engine.plan import load_engine as load
        return load(args.model, options)

    def announce(url: str) -> None:
        shown = args.model_id or (os.path.basename(os.path.normpath(args.model)) if args.model else "the demo model")
        print(f"[server] listening on {url}/v1 (model {shown}; loading, /health says 503 until ready)", flush=True)

    from moestream.engine import timeline

    try:
        # the server's timeline has the host tracks only: its device is known once the engine has loaded
        with timeline.recording(args.timeline):
            return serve(load_engine, host=args.host, port=args.port, api_key=api_key, model_id=args.model_id,
                         max_queue=args.max_queue, parallel=args.parallel, max_context=args.max_context or None,
                         defaults=defaults, max_body_bytes=args.max_body_bytes, shutdown_grace=args.shutdown_grace,
                         log_level=args.log_level, on_listening=announce,
                         speculation=(lambda engine: speculative_options(args, engine)) if speculating(args) else None)
    except MoestreamError as exc:
        print(f"moestream serve: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
