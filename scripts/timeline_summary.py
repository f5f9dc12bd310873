"""Summarize a `moestream ... --timeline TRACE.json` trace: time per kind of work, and the compute
device's idle time by cause (see moestream/bench/timeline_summary.py).

    python scripts/timeline_summary.py TRACE.json [--json]
"""
import sys

from moestream.bench.timeline_summary import main

if __name__ == "__main__":
    sys.exit(main())
