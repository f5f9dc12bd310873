"""`moestream synth --shape NAME OUT`: a packed model with random weights in a real model's shapes
(moestream.bench.synth)."""
from __future__ import annotations

from pathlib import Path

from moestream.bench.synth import BITS, SHAPES, synth
from moestream.commands.args import Parser, fail
from moestream.errors import MoestreamError
from moestream.flag_values import at_least


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="moestream synth", description="A packed model with random weights in a real model's shapes.")
    p.add_argument("out", help="output directory")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES), help="which real model's shapes")
    p.add_argument("--layers", type=at_least(1), default=None, metavar="N", help="keep only the first N layers")
    p.add_argument("--quant", choices=sorted(BITS), default="q4",
                   help="default q4; mxfp4: the experts as MXFP4 records (as convert keeps gpt-oss's), the rest at 4 bits")
    p.add_argument("--seed", type=at_least(0), default=0, metavar="N", help="seed of the random weights (default 0)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty OUT")
    args = p.parse_args(argv)
    try:
        out = synth(args.shape, Path(args.out), layers=args.layers, quant=args.quant, seed=args.seed, force=args.force)
    except MoestreamError as exc:
        return fail("moestream synth", str(exc))
    print(f"wrote {out}")
    return 0
