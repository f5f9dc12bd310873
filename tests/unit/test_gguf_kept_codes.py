"""`moestream convert model.gguf OUT` without --quant: no tensor is stored at fewer bits than the GGUF
gives it. Types with an exact affine form (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, MXFP4) keep the
file's codes, so the converted model is the one `--quant none` gives, bit for bit; MXFP4 experts stay
MXFP4; the others (Q6_K, ...) are re-quantized at 8 bits. The summary says what each class became."""
import json

import numpy as np
import pytest
import torch

from moestream.convert.main import convert
from moestream.cpu_share import kernels as native
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.format.reader import PackedModel
from moestream.quant.affine import QuantSpec, dequantize

gguf = pytest.importorskip("gguf")
from gguf_files import Encoder, random_k_blocks, write_gpt_oss, write_qwen3moe  # noqa: E402 (needs gguf)
from moestream.quant import ggml  # noqa: E402

T = gguf.GGMLQuantizationType
PROMPT = [5, 17, 42, 99, 3, 250]
# the bits a GGUF type gives a weight (its codes; scales aside)
SOURCE_BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8, "Q4_0": 4, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "MXFP4": 4}
# K-quant blocks hold 256 values: every matrix's rows are 256 long
K_SHAPES = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, head_dim=64)
STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def run(model_dir) -> tuple[torch.Tensor, list[int]]:
    engine = Engine.load(model_dir, options=EngineOptions(device="cpu", threads=1), prefetch=False)
    try:
        logits = engine.prefill(PROMPT, all_logits=True)[0]
        tokens = [e.token_id for e in engine.generate(PROMPT, max_new_tokens=8, stop_at_eos=False)]
        return logits, tokens
    finally:
        engine.close()


def same_model(kept, unquantized, monkeypatch) -> None:
    """The kept codes and the unquantized conversion run as the same model: the same tokens; the
    same logits within float32 rounding where the native CPU kernels multiply the kept codes (the
    unquantized weights take the float path), and bit for bit on the float path for both."""
    (logits_a, tokens_a), (logits_b, tokens_b) = run(kept), run(unquantized)
    assert tokens_a == tokens_b
    assert torch.allclose(logits_a, logits_b, rtol=0, atol=1e-4)
    monkeypatch.setattr(native, "_state", {"reason": "the float path"})  # as without the native build
    assert torch.equal(run(kept)[0], run(unquantized)[0])  # the same weights, the same arithmetic: bit for bit


def stored_bits(spec: QuantSpec, dtype_bits: int = 32) -> int:
    return spec.bits if spec.quantized else dtype_bits


def gguf_types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def packed_specs(packed: PackedModel, gguf_name: str, hf_dense: dict[str, str]) -> list[QuantSpec]:
    """The stored specs of what a GGUF tensor became (an expert stack: its projection in every layer's record)."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[2] in STACKS:
        return [QuantSpec.from_json(packed.expert_layer(int(parts[1])).quant[STACKS[parts[2]]])]
    return [packed.tensor_spec(hf_dense[gguf_name])]


def assert_no_tensor_below_source_bits(packed: PackedModel, types: dict[str, str], hf_dense: dict[str, str]):
    for name, type_name in types.items():
        parts = name.split(".")
        assert name in hf_dense or (len(parts) == 4 and parts[2] in STACKS), name  # every tensor is checked
        for spec in packed_specs(packed, name, hf_dense):
            assert stored_bits(spec) >= SOURCE_BITS[type_name], (name, type_name, spec)
            if type_name in ggml.EXACT and spec.mode == "affine":
                assert spec.group_size <= 32, (name, spec)  # never a coarser group than the source's


QWEN3_HF = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}


def qwen3_dense_names(types: dict[str, str]) -> dict[str, str]:
    from gguf_files import QWEN3_BLOCK

    theirs = {v: k for k, v in QWEN3_BLOCK.items()}
    out = dict(QWEN3_HF)
    for name in types:
        parts = name.split(".")
        if len(parts) == 4 and parts[2] in theirs:
            out[name] = f"model.layers.{parts[1]}.{theirs[parts[2]]}.{parts[3]}"
    return out


@pytest.mark.parametrize("type_name", sorted(ggml.EXACT))
def test_exact_types_dequantize_to_ggufs_own_values(type_name):
    """The kept codes, scales and biases give gguf's dequantization of the blocks, bit for bit."""
    qtype, rng = T[type_name], np.random.default_rng(3)
    values = (rng.standard_normal((6, 512)) * 0.05).astype(np.float32)
    values[0, :32] = 0.0  # a constant block
    if type_name in ("Q4_K", "Q5_K"):  # gguf only dequantizes K-quants: random blocks with sane scales
        raw = random_k_blocks((6, 512), qtype, rng)
    else:
        raw = gguf.quants.quantize(values, qtype)
    want = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), np.float32))
    parts = ggml.affine_parts(type_name, torch.from_numpy(raw))
    bits, _, scale_dtype = ggml.EXACT[type_name]
    assert parts["scales"].dtype == parts["biases"].dtype == scale_dtype
    got = dequantize(parts["weight"], parts["scales"], parts["biases"], bits, ggml.GROUP)
    assert torch.equal(got, want)
    assert ggml.plan(type_name, (6, 512)) == ggml.SourcePlan(type_name, QuantSpec(bits, 32), True, scale_dtype)


def test_other_types_are_planned_at_8_bits():
    for type_name in ("Q6_K", "Q3_K", "Q2_K", "IQ4_XS"):
        assert ggml.plan(type_name, (4, 256)) == ggml.SourcePlan(type_name, QuantSpec(8, 32), False)
    assert not ggml.plan("F16", (4, 256)).spec.quantized and not ggml.plan("Q8_0", (256,)).spec.quantized


def test_q8_0_gguf_keeps_its_codes_and_equals_the_unquantized_conversion(tiny_checkpoint, tmp_path, monkeypatch, float_activations):
    src = tiny_checkpoint("qwen3_moe")
    path = write_qwen3moe(src, tmp_path / "tiny-q8.gguf", encode=Encoder(T.Q8_0))
    types = gguf_types(path)
    assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_gate_exps.weight"] == types["output.weight"] == "Q8_0"
    out = convert(path, tmp_path / "default", progress=False, tokenizer=src)
    none = convert(path, tmp_path / "none", quant="none", progress=False, tokenizer=src)
    got, ref = PackedModel(out), PackedModel(none)
    dense_names = qwen3_dense_names(types)
    assert_no_tensor_below_source_bits(got, types, dense_names)
    assert got.tensor_spec("model.layers.0.self_attn.q_proj.weight") == QuantSpec(8, 32)
    assert got.raw_dense("model.layers.0.self_attn.q_proj.scales").dtype == torch.float16
    for layer in (0, 2):
        for expert in (0, 5):
            for proj, t in got.dequantized_expert(layer, expert).items():
                assert torch.equal(t, ref.dequantized_expert(layer, expert)[proj])
    for name in ("model.layers.1.mlp.down_proj.weight", "lm_head.weight", "model.embed_tokens.weight"):
        assert torch.equal(got.dense(name, torch.float32), ref.dense(name, torch.float32)), name
    q = got.manifest.quantization
    assert q["requested"]["quant"] == "source"
    assert q["classes"]["experts"] == q["classes"]["attention"] == q["classes"]["head"] == "8-bit g32 (kept Q8_0 codes)"
    assert q["classes"]["norms and biases"] == "float32"
    # an explicit --quant still decides
    q4 = PackedModel(convert(path, tmp_path / "q4", quant="q4", progress=False, tokenizer=src))
    assert q4.tensor_spec("model.layers.0.self_attn.q_proj.weight") == QuantSpec(4, 64)
    assert q4.manifest.quantization["classes"]["attention"] == "4-bit g64 (re-quantized from Q8_0)"
    same_model(out, none, monkeypatch)


def test_q4_0_gguf_keeps_its_codes(tiny_checkpoint, tmp_path, monkeypatch, float_activations):
    src = tiny_checkpoint("qwen3_moe")
    path = write_qwen3moe(src, tmp_path / "tiny-q4.gguf", encode=Encoder(T.Q4_0))
    out = convert(path, tmp_path / "default", progress=False, tokenizer=src)
    none = convert(path, tmp_path / "none", quant="none", progress=False, tokenizer=src)
    got = PackedModel(out)
    assert_no_tensor_below_source_bits(got, gguf_types(path), qwen3_dense_names(gguf_types(path)))
    assert QuantSpec.from_json(got.expert_layer(0).quant["down_proj"]) == QuantSpec(4, 32)
    same_model(out, none, monkeypatch)


def test_mxfp4_moe_gguf_keeps_mxfp4_experts_and_q8_0_codes(tiny_checkpoint, tmp_path, monkeypatch, float_activations):
    """llama-quantize MXFP4_MOE's gpt-oss: MXFP4 experts, Q8_0 attention, embeddings and head, F32 router."""
    src = tiny_checkpoint("gpt_oss")
    path = tmp_path / "tiny-mxfp4-moe.gguf"
    write_gpt_oss(src, path, expert_type=T.MXFP4, resident_type=T.Q8_0)
    types = gguf_types(path)
    assert types["blk.0.attn_q.weight"] == types["output.weight"] == types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.ffn_gate_exps.weight"] == "MXFP4" and types["blk.0.ffn_gate_inp.weight"] == "F32"
    out = convert(path, tmp_path / "default", progress=False)
    none = convert(path, tmp_path / "none", quant="none", progress=False)
    got = PackedModel(out)
    for layer in (0, 1):
        assert {QuantSpec.from_json(s).mode for s in got.expert_layer(layer).quant.values()} == {"mxfp4"}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight", "lm_head.weight",
                 "model.embed_tokens.weight"):
        assert got.tensor_spec(name) == QuantSpec(8, 32), name
        assert torch.equal(got.dense(name, torch.float32), PackedModel(none).dense(name, torch.float32)), name
    assert not got.tensor_spec("model.layers.0.mlp.router.weight").quantized
    same_model(out, none, monkeypatch)
    classes = got.manifest.quantization["classes"]
    assert classes["experts"] == "MXFP4 (kept)"
    assert classes["attention"] == classes["head"] == classes["embeddings"] == "8-bit g32 (kept Q8_0 codes)"
    assert classes["router"] == classes["norms and biases"] == "float32"
    assert json.loads((out / "moestream.json").read_text())["quantization"]["classes"] == classes


def k_mixture(name: str) -> object:
    """Q4_K_M's choice, roughly: Q6_K for the down projections, v, and the head; Q4_K elsewhere."""
    return T.Q6_K if any(k in name for k in ("ffn_down", "attn_v", "output.weight")) else T.Q4_K


def test_k_quant_mixture_stores_no_tensor_below_its_source_bits(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen3_moe", **K_SHAPES)
    encoders = {q: Encoder(q, seed=i) for i, q in enumerate((T.Q4_K, T.Q6_K))}
    path = write_qwen3moe(src, tmp_path / "tiny-q4_k_m.gguf", encode=lambda n, v: encoders[k_mixture(n)](n, v))
    types = gguf_types(path)
    assert types["blk.0.ffn_down_exps.weight"] == "Q6_K" and types["blk.0.ffn_gate_exps.weight"] == "Q4_K"
    out = convert(path, tmp_path / "default", progress=False, tokenizer=src)
    got = PackedModel(out)
    dense_names = qwen3_dense_names(types)
    assert_no_tensor_below_source_bits(got, types, dense_names)
    quant = got.expert_layer(0).quant
    assert QuantSpec.from_json(quant["gate_proj"]) == QuantSpec(4, 32)
    assert QuantSpec.from_json(quant["down_proj"]) == QuantSpec(8, 32)
    # Q4_K: the file's values exactly; Q6_K: within half an 8-bit step of them
    held = {**encoders[T.Q4_K].dequantized, **encoders[T.Q6_K].dequantized}
    for expert in (0, 7):
        record = got.dequantized_expert(2, expert)
        assert torch.equal(record["gate_proj"], torch.from_numpy(held["blk.2.ffn_gate_exps.weight"][expert]))
        want = torch.from_numpy(held["blk.2.ffn_down_exps.weight"][expert])
        step = (want.reshape(-1, 32).amax(1) - want.reshape(-1, 32).amin(1)) / 255
        assert ((record["down_proj"] - want).abs().reshape(-1, 32) <= step[:, None] * 0.51 + 1e-7).all()
    assert torch.equal(got.dense("model.layers.0.self_attn.q_proj.weight", torch.float32),
                       torch.from_numpy(held["blk.0.attn_q.weight"]))
    classes = got.manifest.quantization["classes"]
    assert classes["experts"] == "4-bit g32 (kept Q4_K codes) ×4, 8-bit g32 (re-quantized from Q6_K) ×2"
    assert classes["head"] == "8-bit g32 (re-quantized from Q6_K)"


@pytest.mark.parametrize("type_name,dtype", [("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_16_bit_float_gguf_stays_in_its_dtype(tiny_checkpoint, tmp_path, type_name, dtype):
    """F16 and BF16 matrices are neither quantized nor widened by default: the file's values, in its dtype."""
    src = tiny_checkpoint("qwen3_moe")
    encoder = Encoder(T[type_name])
    path = write_qwen3moe(src, tmp_path / f"tiny-{type_name}.gguf", encode=encoder)
    got = PackedModel(convert(path, tmp_path / "default", progress=False, tokenizer=src))
    name = "model.layers.0.self_attn.o_proj.weight"
    assert not got.tensor_spec(name).quantized and got.raw_dense(name).dtype == dtype
    assert torch.equal(got.raw_dense(name).float(), torch.from_numpy(encoder.dequantized["blk.0.attn_output.weight"]))
    assert got.dequantized_expert(0, 3, torch.float32)["up_proj"].dtype == torch.float32
    assert got.expert_tensors(0, 3)["up_proj.weight"].dtype == dtype
    classes = got.manifest.quantization["classes"]
    assert classes["experts"] == classes["attention"] == classes["head"] == {"F16": "float16", "BF16": "bfloat16"}[type_name]


def test_a_block_scale_float16_biases_cannot_hold_is_one_line():
    block = np.zeros((1, 34), np.uint8)
    block[0, :2] = np.array([600.0], np.float16).view(np.uint8)  # −128 · 600 is beyond float16
    from moestream.errors import MoestreamError
    with pytest.raises(MoestreamError, match=r"^blk.0.attn_q.weight: GGUF Q8_0 block scales above 511"):
        ggml.affine_parts("Q8_0", torch.from_numpy(block).reshape(1, 34), name="blk.0.attn_q.weight")
