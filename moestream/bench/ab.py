"""`moestream ab "CMD_A" "CMD_B"`: is B really faster (or slower) than A, or is it noise?

Runs two shell commands in A B B A order, round after round, so a slow drift of the machine
(heat, page cache, another job) weighs on both sides alike. Each run gives one number: the last
line of its stdout, or with `--metric PATH` a field of the JSON file it writes to `{out}`.

The answer is the ratio of means B/A with a bootstrap 95 % confidence interval (resampling whole
rounds, which keeps each round's pairing), and a noise floor: how far apart two runs of the same
command A land within one round (the 95th percentile of |A₂/A₁ − 1|). A difference counts as
real when the interval excludes 1 and the ratio is further from 1 than the noise floor.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shlex
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moestream.bench.plots import pyplot, save_png

log = logging.getLogger(__name__)

ORDER = ("A", "B", "B", "A")  # one round
RESAMPLES = 10_000
NOISE_QUANTILE = 0.95


class ABError(Exception):
    """A run failed or gave no usable number: one line for the user."""


@dataclass
class Run:
    label: str  # "A" or "B"
    round: int
    index: int  # position in the whole sequence, 0-based (the command's {run})
    value: float
    seconds: float  # wall time of the command


def metric_at(data: Any, path: str) -> Any:
    """`decode.tok_s` or `runs.-1.decode.tok_s`: keys of objects, whole numbers index lists."""
    node = data
    for part in path.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and _is_int(part) and -len(node) <= int(part) < len(node):
            node = node[int(part)]
        else:
            raise KeyError(part)
    return node


def _is_int(text: str) -> bool:
    return text.lstrip("-").isdigit()


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ABError(f"{where} is {json.dumps(value)[:60]}, not a finite number")
    if value <= 0:
        raise ABError(f"{where} is {value}: ratios need positive numbers")
    return float(value)


def measure(label: str, command: str, index: int, *, metric: str | None, timeout: float | None) -> tuple[float, float]:
    """Run one command; (its number, its seconds)."""
    with tempfile.TemporaryDirectory(prefix="moestream-ab-") as tmp:
        out = os.path.join(tmp, "out.json")
        # str.replace, not str.format: commands are full of braces (python -c, JSON)
        line = command.replace("{out}", shlex.quote(out)).replace("{run}", str(index))
        start = time.perf_counter()
        try:
            proc = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ABError(f"command {label} ran longer than --timeout {timeout:g} s: {command}") from None
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no output on stderr)"])[-1]
            raise ABError(f"command {label} exited with {proc.returncode}: {tail}")
        if metric is None:
            lines = [x for x in proc.stdout.splitlines() if x.strip()]
            try:
                value = json.loads(lines[-1]) if lines else None
            except ValueError:
                value = lines[-1]
            if value is None:
                raise ABError(f"command {label} printed no number on its last line ({command})")
            return _number(value, f"the last line of command {label}"), seconds
        try:
            data = json.loads(Path(out).read_text())
        except FileNotFoundError:
            raise ABError(f"command {label} wrote nothing to {{out}} ({command})") from None
        except ValueError as exc:
            raise ABError(f"command {label} wrote a file to {{out}} that is not JSON: {exc}") from None
        try:
            value = metric_at(data, metric)
        except KeyError as exc:
            raise ABError(f"command {label}'s JSON has no {metric!r} (no {exc.args[0]!r})") from None
        return _number(value, f"{metric} of command {label}"), seconds


def run_rounds(command_a: str, command_b: str, *, rounds: int, metric: str | None = None,
               warmup: int = 0, timeout: float | None = None) -> list[Run]:
    commands = {"A": command_a, "B": command_b}
    for i in range(warmup):  # discarded: first runs pay for cold caches and compilation
        for label in ("A", "B"):
            measure(label, commands[label], -1 - i, metric=metric, timeout=timeout)
    runs: list[Run] = []
    for r in range(rounds):
        for label in ORDER:
            value, seconds = measure(label, commands[label], len(runs), metric=metric, timeout=timeout)
            runs.append(Run(label, r, len(runs), value, round(seconds, 4)))
            log.info("round %d %s: %g (%.2f s)", r, label, value, seconds)
    return runs


def analyse(runs: list[Run], *, seed: int = 0, resamples: int = RESAMPLES) -> dict:
    """Ratio of means B/A, its bootstrap 95 % interval over rounds, and the A-A noise floor."""
    rounds = sorted({run.round for run in runs})
    a = np.array([[x.value for x in runs if x.round == r and x.label == "A"] for r in rounds])  # [N, 2]
    b = np.array([[x.value for x in runs if x.round == r and x.label == "B"] for r in rounds])  # [N, 2]
    ratio = float(b.mean() / a.mean())
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(rounds), size=(resamples, len(rounds)))
    boot = b.mean(axis=1)[picks].mean(axis=1) / a.mean(axis=1)[picks].mean(axis=1)
    low, high = (float(v) for v in np.percentile(boot, [2.5, 97.5]))
    aa = a[:, 1] / a[:, 0]  # the second A of each round over its first
    bb = b[:, 1] / b[:, 0]
    noise = float(np.quantile(np.abs(aa - 1.0), NOISE_QUANTILE))
    above = (low > 1.0 or high < 1.0) and abs(ratio - 1.0) > noise
    return {"ratio": round(ratio, 6), "ci95": [round(low, 6), round(high, 6)],
            "noise_floor": round(noise, 6), "above_noise": bool(above),
            "mean_a": float(a.mean()), "mean_b": float(b.mean()),
            "aa_ratios": [round(float(x), 6) for x in aa], "bb_ratios": [round(float(x), 6) for x in bb],
            "resamples": resamples, "seed": seed}


def verdict(result: dict) -> str:
    low, high = result["ci95"]
    where = "above" if result["above_noise"] else "within"
    return (f"B/A = {result['ratio']:.4f} (95 % CI {low:.4f} to {high:.4f}); A-A noise floor "
            f"±{100 * result['noise_floor']:.2f} %: {where} the noise floor")


def plot(report: dict, path: str) -> None:
    runs = report["runs"]
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(9, 3.5))
    for label, colour in (("A", "#4C72B0"), ("B", "#DD8452")):
        xs = [r["index"] for r in runs if r["label"] == label]
        left.plot(xs, [r["value"] for r in runs if r["label"] == label], "o", color=colour, label=label)
    left.set_xlabel("run (A B B A per round)")
    left.set_ylabel(report["metric"] or "value")
    left.legend()
    result = report["result"]
    noise = result["noise_floor"]
    right.axvspan(1 - noise, 1 + noise, color="#cccccc", label="A-A noise floor")
    low, high = result["ci95"]
    right.errorbar([result["ratio"]], [0], xerr=[[result["ratio"] - low], [high - result["ratio"]]], fmt="o",
                   color="#DD8452", capsize=6, label="B/A, 95 % CI")
    right.axvline(1.0, color="black", linewidth=0.8)
    right.set_yticks([])
    right.set_xlabel("B / A")
    right.legend(loc="upper left", fontsize=8)
    fig.suptitle(verdict(result), fontsize=9)
    save_png(fig, path)
