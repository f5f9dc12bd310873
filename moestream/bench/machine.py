"""What a benchmark ran on, recorded with every result."""
from __future__ import annotations

import os
import platform
import shlex
import sys

import torch


def command_line() -> str:
    """The command as typed, shell-quoted: `moestream ...` whether it ran as the console script or
    as `python -m moestream`."""
    args = sys.argv[1:]
    if sys.argv and not (sys.argv[0].endswith("moestream") or sys.argv[0].endswith(os.path.join("moestream", "__main__.py"))):
        return shlex.join(sys.argv)
    return shlex.join(["moestream", *args])


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "command": command_line()}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info
