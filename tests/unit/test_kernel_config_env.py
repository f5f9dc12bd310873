"""MOESTREAM_KERNEL_CONFIG: block sizes for tuning runs, from JSON or a file; bad values are one-line errors;
benchmarks record it."""
import json

import pytest

from moestream.bench.machine import machine_info
from moestream.kernels.expert_layout import KernelConfig, configured


def test_unset_gives_the_defaults():
    assert configured(None) == KernelConfig() and configured("") == KernelConfig()


def test_json_and_file_override_only_what_they_name(tmp_path):
    cfg = configured('{"gemv_down_n": 8, "block_m": 32}')
    assert cfg.gemv_down_n == 8 and cfg.block_m == 32 and cfg.gemv_gate_up_n == KernelConfig().gemv_gate_up_n
    path = tmp_path / "best.json"
    path.write_text(json.dumps({"gemv_gate_up_warps": 2}))
    assert configured(str(path)).gemv_gate_up_warps == 2


@pytest.mark.parametrize("raw,needle", [('{"gemv_down_n": "8"}', "non-negative int"),
                                        ('{"no_such_tile": 8}', "names among"),
                                        ('{"block_m": -1}', "non-negative int"),
                                        ("/no/such/file.json", "not a JSON object or a readable JSON file"),
                                        ("{not json", "not a JSON object")])
def test_bad_values_are_one_line_errors(raw, needle):
    with pytest.raises(ValueError, match=needle) as err:
        configured(raw)
    assert "\n" not in str(err.value) and "MOESTREAM_KERNEL_CONFIG" in str(err.value)


def test_benchmarks_record_the_setting(monkeypatch):
    monkeypatch.setenv("MOESTREAM_KERNEL_CONFIG", '{"gemv_down_n": 8}')
    assert machine_info()["environment"]["MOESTREAM_KERNEL_CONFIG"] == '{"gemv_down_n": 8}'
    monkeypatch.delenv("MOESTREAM_KERNEL_CONFIG")
    assert "environment" not in machine_info() or "MOESTREAM_KERNEL_CONFIG" not in machine_info()["environment"]


def test_the_cli_stops_on_a_bad_setting_with_one_line():
    import os
    import subprocess
    import sys

    env = {**os.environ, "MOESTREAM_KERNEL_CONFIG": '{"no_such_tile": 1}'}
    proc = subprocess.run([sys.executable, "-m", "moestream", "bench", "--device", "cpu"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "MOESTREAM_KERNEL_CONFIG" in proc.stderr
