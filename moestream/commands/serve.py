"""`moestream serve`: the OpenAI-compatible HTTP server's flags (moestream.server.main binds, loads,
serves and stops)."""
from __future__ import annotations

import argparse
import logging
import os

from moestream.commands.args import Parser, check_output_paths, fail
from moestream.commands.engine_args import check_engine_args, digest_dir, options_from_args
from moestream.errors import MoestreamError
from moestream.flag_values import at_least, finite_float, non_negative_float, probability_mass
from moestream.server.app import DEFAULT_MAX_BODY_BYTES, RequestDefaults
from moestream.server.main import serve
from moestream.server.reasoning import FORMATS as REASONING_FORMATS

API_KEY_ENV = "MOESTREAM_API_KEY"


def port_value(text: str) -> int:
    value = at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be at most 65535, not {value}")
    return value


def build_parser(*, engine_arguments: bool = True) -> argparse.ArgumentParser:
    parser = Parser(
        prog="moestream serve",
        description="Serve a packed MoE model over the OpenAI HTTP API (/v1/chat/completions, /v1/completions, "
                    "/v1/models; also under /api/v1) with /health and /metrics. Up to --parallel requests generate "
                    "together (continuous batching); more wait in a queue bounded by their prompt tokens (--queue-tokens).")
    parser.add_argument("--model", default=None,
                        help="packed model directory (default: the built-in demo model)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; 0.0.0.0 for other machines: put a TLS "
                             "proxy in front)")
    parser.add_argument("--port", type=port_value, default=8080, help="port (default 8080; 0 picks a free one)")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1 and /api/v1 (also ${API_KEY_ENV})")
    parser.add_argument("--parallel", type=at_least(1), default=1,
                        help="requests that generate together, each in its own sequence slot and KV cache, joining "
                             "and leaving the batch at step boundaries (default 1: one at a time)")
    parser.add_argument("--max-queue", "--queue-size", dest="max_queue", type=at_least(0), default=None,
                        help="requests that may wait beyond the --parallel running ones (default: no count limit, "
                             "only --queue-tokens); beyond that, 503 with Retry-After")
    parser.add_argument("--queue-tokens", type=at_least(1), default=None,
                        help="prompt tokens the waiting requests may hold in all (default: 1/64 of the machine's "
                             "memory at 64 bytes a token, e.g. 4 M tokens on 16 GiB); a request beyond it gets 503 "
                             "with Retry-After, unless nothing else waits")
    parser.add_argument("--model-id", default=None,
                        help="the id /v1/models advertises (default: the model's name); requests may name any model")
    defaults = RequestDefaults()
    parser.add_argument("--temperature", type=finite_float, default=defaults.temperature,
                        help=f"default temperature for requests without one (default {defaults.temperature})")
    parser.add_argument("--top-k", type=at_least(0), default=defaults.top_k,
                        help=f"default top-k (default {defaults.top_k}; 0 off)")
    parser.add_argument("--top-p", type=probability_mass, default=defaults.top_p,
                        help=f"default top-p (default {defaults.top_p})")
    parser.add_argument("--max-tokens", type=at_least(1), default=None,
                        help="default completion limit (default: the rest of the context)")
    parser.add_argument("--reasoning-format", choices=REASONING_FORMATS, default="auto",
                        help="where a reply's reasoning goes: apart from the content (auto, the default: a <think> "
                             "block or gpt-oss's analysis channel becomes reasoning_content, a reasoning item, a "
                             "thinking block) or left in it (none)")
    parser.add_argument("--max-body-bytes", type=at_least(1), default=DEFAULT_MAX_BODY_BYTES,
                        help=f"largest request body accepted, else 413 (default {DEFAULT_MAX_BODY_BYTES})")
    parser.add_argument("--shutdown-grace", type=non_negative_float, default=10.0,
                        help="seconds running requests may take to finish after SIGTERM (default 10)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--timeline", metavar="FILE.json", default=None,
                        help="write a Chrome/Perfetto trace of everything the engine did while serving (host tracks: "
                             "steps, prefill chunks, expert loads, read waits, reads and copies, the decoder's segments), "
                             "written when the server stops")
    if engine_arguments:
        # the engine's flags (device, dtype, --max-context, prefill chunk, ...)
        from moestream.commands.engine_args import add_engine_arguments
        from moestream.commands.speculative_flags import add_speculative_arguments
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
    return RequestDefaults(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           max_tokens=args.max_tokens)


def api_key_from(args: argparse.Namespace, environ: dict | None = None) -> str | None:
    """--api-key, else $MOESTREAM_API_KEY (keeps the key off the command line), else none."""
    environ = os.environ if environ is None else environ
    return args.api_key or environ.get(API_KEY_ENV) or None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_output_paths(parser, args, {"trace_routing": "--trace-routing", "timeline": "--timeline"})
    check_engine_args(parser, args)
    from moestream.commands.speculative_flags import check_speculative_args, speculating, speculative_options

    # requests bring their own sampling settings
    check_speculative_args(parser, args, sampling=None, model_dir=args.model, batched=args.parallel > 1)
    defaults = defaults_from_args(args, parser)
    if args.model is not None:  # a path that is no model stops here, not after the server has started
        from moestream.format.reader import PackedModel

        try:
            PackedModel(args.model)
        except MoestreamError as exc:
            return fail("moestream serve", str(exc))
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = options_from_args(args)
    options.max_sequences = args.parallel  # a sequence slot (its own KV cache) per request running at once
    api_key = api_key_from(args)

    def load_engine():
        from moestream.engine.engine import load_engine as load
        return load(args.model, options, digest_dir=digest_dir())

    def announce(url: str) -> None:
        shown = args.model_id or (os.path.basename(os.path.normpath(args.model)) if args.model else "the demo model")
        print(f"[server] listening on {url}/v1 (model {shown}; loading, /health says 503 until ready)", flush=True)

    from moestream.engine import timeline

    try:
        # the server's timeline has the host tracks only: its device is known once the engine has loaded
        with timeline.recording(args.timeline):
            return serve(load_engine, host=args.host, port=args.port, api_key=api_key, model_id=args.model_id,
                         max_queue=args.max_queue, queue_tokens=args.queue_tokens, parallel=args.parallel, max_context=args.max_context or None,
                         defaults=defaults, max_body_bytes=args.max_body_bytes, shutdown_grace=args.shutdown_grace,
                         log_level=args.log_level, on_listening=announce, reasoning_format=args.reasoning_format,
                         speculation=(lambda engine: speculative_options(args, engine)) if speculating(args) else None)
    except MoestreamError as exc:
        return fail("moestream serve", str(exc))

