"""`moestream serve` around the fake engine, as a real process (for signal tests and the soak).

Same flags as `moestream serve` without the engine's, plus the fake engine's knobs. Prints the
URL it listens on as its first line of output, and "engine closed" when the engine is closed.
"""
from __future__ import annotations

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fake_engine import FakeEngine  # noqa: E402

from moestream.errors import MoestreamError  # noqa: E402
from moestream.commands.serve import api_key_from, build_parser, defaults_from_args
from moestream.server.main import serve  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(engine_arguments=False)
    parser.add_argument("--token-delay", type=float, default=0.0, help="seconds per generated token")
    parser.add_argument("--prefill-delay", type=float, default=0.0, help="seconds per prompt token")
    parser.add_argument("--eos-every", type=int, default=0, help="about one unit in N ends the reply")
    parser.add_argument("--fail-load", action="store_true", help="make loading the model fail")
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def load() -> FakeEngine:
        if args.fail_load:
            raise MoestreamError("the fake model was told not to load")
        engine = FakeEngine(max_context=args.max_context or 4096, token_delay=args.token_delay,
                            prefill_delay=args.prefill_delay, eos_every=args.eos_every)
        engine.on_close = lambda: print("engine closed", flush=True)
        return engine

    try:
        return serve(load, host=args.host, port=args.port, api_key=api_key_from(args), model_id=args.model_id,
                     max_queue=args.max_queue, queue_tokens=args.queue_tokens, defaults=defaults_from_args(args),
                     max_body_bytes=args.max_body_bytes,
                     shutdown_grace=args.shutdown_grace, log_level=args.log_level,
                     reasoning_format=args.reasoning_format,
                     on_listening=lambda url: print(url, flush=True))
    except MoestreamError as exc:
        print(f"fake server: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
