"""Every GGUF type people download, imported: a tiny Qwen3-MoE written as GGUF with its matrices
(experts, attention, embeddings, head) in one type. The imported values equal gguf's own
dequantization of the bytes in the file, and the model generates the same tokens as the safetensors
checkpoint holding those values, both converted at --quant none (for F16 and BF16: the original
rounded by torch to float16 / bfloat16, so gguf's rounding is checked too)."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from moestream.convert.main import convert
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.format.reader import PackedModel
from tiny import load_all

gguf = pytest.importorskip("gguf")
from gguf_files import QWEN3_BLOCK, Encoder, can_quantize, write_qwen3moe  # noqa: E402 (needs gguf)

T = gguf.GGMLQuantizationType
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]
TORCH_FLOAT = {"F16": torch.float16, "BF16": torch.bfloat16}
# K-quant blocks hold 256 values: every matrix's rows are 256 long (o_proj: 4 heads of 64)
SHAPES = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, head_dim=64)
PROMPT = [5, 17, 42, 99, 3, 250]


def hf_name(gguf_name: str) -> str:
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    _, layer, what, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{ {v: k for k, v in QWEN3_BLOCK.items()}[what]}.weight"


def same_checkpoint(src, out, values: dict[str, torch.Tensor]):
    """`src` with its tensors replaced by `values`."""
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v.contiguous() for k, v in values.items()}, str(out / "model.safetensors"))
    return out


def run(model_dir) -> tuple[torch.Tensor, list[int]]:
    engine = Engine.load(model_dir, options=EngineOptions(device="cpu", threads=1), prefetch=False)
    try:
        logits = engine.prefill(PROMPT, all_logits=True)[0]
        tokens = [e.token_id for e in engine.generate(PROMPT, max_new_tokens=8, stop_at_eos=False)]
        return logits, tokens
    finally:
        engine.close()


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe", **SHAPES)


@pytest.mark.parametrize("type_name", TYPES)
def test_type_imports_as_gguf_dequantizes_it_and_generates_the_same_tokens(checkpoint, tmp_path, type_name):
    qtype = T[type_name]
    encoder = Encoder(qtype)
    path = write_qwen3moe(checkpoint, tmp_path / f"tiny-{type_name}.gguf", encode=encoder)
    # the file really holds the type where llama.cpp would put it
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type for t in reader.tensors}
    for name in ("blk.0.ffn_gate_exps.weight", "blk.2.ffn_down_exps.weight", "blk.0.attn_q.weight",
                 "blk.1.ffn_up.weight", "token_embd.weight", "output.weight"):
        assert types[name] == qtype == encoder.encoded[name], name
    assert types["blk.0.ffn_gate_inp.weight"] == T.F32
    if not can_quantize(qtype):
        assert type_name.endswith("_K")  # the blocks were written here, not by gguf

    out = convert(path, tmp_path / "gguf", quant="none", progress=False, tokenizer=checkpoint)
    got = PackedModel(out)
    # experts and resident matrices: exactly gguf's dequantization of the bytes written
    for layer in (0, 2):
        for proj, stack in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            want = torch.from_numpy(encoder.dequantized[f"blk.{layer}.{stack}.weight"])
            for expert in range(8):
                assert torch.equal(got.dequantized_expert(layer, expert)[proj], want[expert]), (layer, proj, expert)
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "token_embd.weight", "output.weight"):
        assert torch.equal(got.dense(hf_name(name), torch.float32), torch.from_numpy(encoder.dequantized[name])), name

    original = load_all(checkpoint)
    if type_name in TORCH_FLOAT:  # the original rounded by torch: gguf must round the same way
        values = {k: v.to(TORCH_FLOAT[type_name]) if v.dim() >= 2 and ".mlp.gate." not in k else v
                  for k, v in original.items()}
        for name, dequantized in encoder.dequantized.items():
            if encoder.encoded[name] == qtype and "_exps." not in name:
                assert torch.equal(values[hf_name(name)].float(), torch.from_numpy(dequantized)), name
    else:  # the values gguf dequantizes, as float32
        values = dict(original)
        for name, dequantized in encoder.dequantized.items():
            if "_exps." in name:
                layer, stack = int(name.split(".")[1]), name.split(".")[2]
                proj = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}[stack]
                for e in range(8):
                    values[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = torch.from_numpy(dequantized[e].copy())
            else:
                values[hf_name(name)] = torch.from_numpy(dequantized.copy())
    reference = convert(same_checkpoint(checkpoint, tmp_path / "same", values), tmp_path / "st", quant="none",
                        progress=False)
    if type_name in TORCH_FLOAT:
        for layer, expert in ((0, 3), (2, 7)):
            for proj, t in PackedModel(reference).dequantized_expert(layer, expert).items():
                assert torch.equal(got.dequantized_expert(layer, expert)[proj], t)
    (logits_a, tokens_a), (logits_b, tokens_b) = run(out), run(reference)
    assert torch.equal(logits_a, logits_b)
    assert tokens_a == tokens_b
    if type_name != "F32":  # the type changed the model: the comparison can tell models apart
        assert not torch.equal(logits_a, run(convert(checkpoint, tmp_path / "orig", quant="none", progress=False))[0])


def test_k_quant_blocks_are_written_in_llama_cpp_layout():
    """The hand-written K-quant blocks dequantize to small finite values, and the Q4_K layout they
    assume (d, dmin, 12 bytes of 6-bit sub-scales and mins, codes) is the one gguf reads."""
    rng = np.random.default_rng(1)
    from gguf_files import random_k_blocks

    for qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        raw = random_k_blocks((4, 256), qtype, rng)
        values = gguf.quants.dequantize(raw, qtype)
        assert values.shape == (4, 256) and np.isfinite(values).all()
        assert 0.01 < np.abs(values).max() < 0.5 and values.std() > 0.01
    # Q4_K: d = 1, dmin = 0.5, every sub-scale 0 and every min 2 -> every value is −1
    block = np.zeros(144, np.uint8)
    block[0:2] = np.array([1.0], np.float16).view(np.uint8)
    block[2:4] = np.array([0.5], np.float16).view(np.uint8)
    block[8:12] = 2  # mins of sub-blocks 0-3 (low 6 bits)
    block[12:16] = 0x20  # high halves of sub-blocks 4-7: mins 2 (bits 4-7), scales 0
    assert np.array_equal(gguf.quants.dequantize(block[None], T.Q4_K), np.full((1, 256), -1.0, np.float32))
