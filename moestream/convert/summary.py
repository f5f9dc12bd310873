"""What a conversion made of each class of tensor (experts, attention, head, ...), said in a line
each: recorded in moestream.json's quantization as `classes` and logged when convert finishes."""
from __future__ import annotations

import re
from collections import Counter

from moestream.quant.affine import QuantSpec
from moestream.quant.mxfp4 import MODE as MXFP4

FLOAT_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
SOURCE_FLOATS = ("F32", "F16", "BF16", "F64")
# (class, pattern on the packed name), first match wins
CLASSES = (("experts", re.compile(r"\.experts\.|\.switch_mlp\.")),
           ("norms and biases", re.compile(r"(norm|\.bias|_bias|\.sinks|\.biases)$|norm\.weight$|\.e_score_correction")),
           ("embeddings", re.compile(r"embed_tokens")), ("head", re.compile(r"lm_head")),
           ("shared experts", re.compile(r"shared_expert")),
           ("router", re.compile(r"\.(mlp|block_sparse_moe)\.(gate|router)(\.|$)|\.router\.")),
           ("attention", re.compile(r"\.(self_attn|attention|linear_attn|attn)\.")),
           ("dense MLP", re.compile(r"\.mlp\.")))
ORDER = [c for c, _ in CLASSES] + ["other"]


def tensor_class(name: str) -> str:
    return next((c for c, pattern in CLASSES if pattern.search(name)), "other")


def describe(spec: QuantSpec, origin, dtype: str, *, kept: bool) -> str:
    """How one tensor is stored: `origin` is the source's plan for it (moestream.quant.ggml.SourcePlan)
    or None; kept: its values are the source's own (kept codes or copied floats)."""
    if spec.mode == MXFP4:
        return "MXFP4 (kept)"
    source_type = getattr(origin, "type_name", None)
    if spec.quantized:
        text = f"{spec.bits}-bit g{spec.group_size}"
        if kept:
            return f"{text} (kept {source_type} codes)" if source_type else f"{text} (kept)"
        if source_type and source_type not in SOURCE_FLOATS:
            return f"{text} (re-quantized from {source_type})"
        return text
    text = FLOAT_NAMES.get(dtype, dtype)
    if source_type and source_type != dtype:
        text += f" (from {source_type})" if source_type in SOURCE_FLOATS else f" (dequantized {source_type})"
    return text


def class_table(described: dict[str, str]) -> dict[str, str]:
    """{tensor name: its description} -> {class: what its tensors became}, classes in a fixed order; a
    class whose tensors differ lists each description with its count, the most common first."""
    by_class: dict[str, Counter] = {}
    for name, how in described.items():
        by_class.setdefault(tensor_class(name), Counter())[how] += 1
    table = {}
    for cls in ORDER:
        if cls in by_class:
            counts = by_class[cls].most_common()
            table[cls] = counts[0][0] if len(counts) == 1 else ", ".join(f"{how} ×{n}" for how, n in counts)
    return table


def summary_text(classes: dict[str, str]) -> str:
    """The classes as `convert` reports them, one line each."""
    return "\n".join(f"{cls}: {how}" for cls, how in classes.items())
