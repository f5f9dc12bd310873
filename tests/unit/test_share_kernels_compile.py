"""The CPU share's device programs (moestream.kernels.triton_mailbox, triton_wait, the slot map
with its withheld count, probe and gate, and the records' gather), with and without PDL, compile
for an H100/H200 (sm_90) on a machine without a GPU: the interpreter runs Python and accepts code
the compiler may refuse (scalar branches, masked scalar loads of host memory, stores into pinned
RAM's views). Skipped where Triton or its NVIDIA backend is missing."""
import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moestream.kernels import triton_gather as tg  # noqa: E402
from moestream.kernels import triton_mailbox as tm  # noqa: E402
from moestream.kernels import triton_slot_map as sm  # noqa: E402
from moestream.kernels import triton_wait as tw  # noqa: E402

I64 = ("withheld_ptr", "seq_ptr", "ack_ptr", "late_ptr", "asked_ptr", "head_out", "empty_ptr", "lookup_out",
       "lost_out", "lost_count_ptr", "lost_ptr", "ids_ptr", "owner_ptr", "stamp_ptr", "host_slot_ptr", "clock_ptr",
       "hits_ptr", "misses_ptr", "away_ptr", "src_ptr", "dst_ptr", "calls_ptr", "slot_layer_ptr")
SCALARS_I64 = ("EMPTY_KEY", "HELD_KEY")
POINTERS = {**{name: "i64" for name in I64}, "x_ptr": "bf16", "x_out": "bf16", "ids_out": "i32", "w_ptr": "fp32",
            "w_out": "fp32", "mask_out": "i8", "table_ptr": "i32", "rows_ptr": "fp32", "o_ptr": "fp32",
            "ok_ptr": "i32", "gate_out": "i32", "gate_ptr": "i32", "redo_out": "i32", "withhold_ptr": "i32",
            "todo_ptr": "i8", "src_idx_ptr": "i64", "dst_idx_ptr": "i64"}


def compile_for_sm90(kernel, constants: dict) -> str:
    signature = {name: "constexpr" if name in constants else "*" + POINTERS[name] if name in POINTERS
                 else "i64" if name in SCALARS_I64 else "i32" for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4})
    return compiled.asm["ptx"]


@pytest.mark.parametrize("name, kernel, constants", [
    ("post", tm._post, {"H": 2048, "BLOCK_H": 1024, "BLOCK_P": 16}),
    ("publish", tm._publish, {}),
    ("take_rows", tm._take_rows, {"H": 2048, "BLOCK_H": 1024}),
    ("lost_pairs", tm._lost_pairs, {"BLOCK_P": 16}),
    ("redo_table", tm._redo_table, {"BLOCK_E": 128, "BLOCK_P": 16}),
    ("wait", tw._wait_for_host, {}),
    ("gather", tg._gather, {"BLOCK": 4096}),
    ("slot_map", sm._slot_map, {"BLOCK_P": 16, "BLOCK_S": 2048, "WITHHOLD": True, "COUNT": True,
                                "PROBE": True, "WITHHELD": True, "GATED": True, "CYCLE": True, "TABLE": False,
                                "TABLE_TOP": 0}),
    ("slot_map-counts", sm._slot_map, {"BLOCK_P": 16, "BLOCK_S": 2048, "WITHHOLD": True, "COUNT": True,
                                       "PROBE": True, "WITHHELD": True, "GATED": True,
                                       "CYCLE": True, "TABLE": True, "TABLE_TOP": 64}),
    ("slot_map-gated-only", sm._slot_map, {"BLOCK_P": 16, "BLOCK_S": 2048, "WITHHOLD": False, "COUNT": False,
                                           "PROBE": False, "WITHHELD": False, "GATED": True,
                                           "CYCLE": True, "TABLE": False, "TABLE_TOP": 0}),
    ("slot_map-lru", sm._slot_map, {"BLOCK_P": 16, "BLOCK_S": 2048, "WITHHOLD": True, "COUNT": True,
                                    "PROBE": True, "WITHHELD": True, "GATED": True,
                                    "CYCLE": False, "TABLE": False, "TABLE_TOP": 0}),
])
@pytest.mark.parametrize("pdl", [False, True])
def test_the_share_programs_compile_for_sm90(name, kernel, constants, pdl):
    ptx = compile_for_sm90(kernel, {**constants, "PDL": pdl})
    assert ".entry" in ptx
    assert ("griddepcontrol.wait" in ptx) == pdl  # launched with PDL: the kernel before it complete first
    if name == "wait":
        assert "ld.volatile" in ptx  # each poll reads host memory again
