"""`moestream synth --shape NAME OUT`: a packed model with random weights in a real model's shapes,
written directly (no checkpoint, no download), for real-size benchmarks.

Random weights do not route like a trained model: on the Qwen3-30B-A3B shape they route very
unevenly (a 25 % cache hits about 95 % in decode), so hit rates measured on them say little about
real reuse; speeds at a given hit rate are what these models measure.

`quant` "mxfp4" writes the experts as MXFP4 records (moestream.quant.mxfp4: what convert keeps of
gpt-oss's checkpoints) and the resident matrices at 4 bits."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from moestream.convert.layout import activation_params, expert_activation, fused_layout, with_activation
from moestream.errors import MoestreamError
from moestream.format.manifest import EXPERT_PROJECTIONS
from moestream.format.writer import ExpertFileWriter, finish_model
from moestream.models.base import EMBEDDING
from moestream.models.registry import family_module, weight_shapes
from moestream.quant import mxfp4
from moestream.quant.affine import QuantSpec, packed_shape

QWEN3_30B = dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                 intermediate_size=6144, vocab_size=151936, norm_topk_prob=True, rope_theta=1000000.0,
                 max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False, decoder_sparse_step=1,
                 mlp_only_layers=[], eos_token_id=151645)
SHAPES = {
    "qwen3-30b-a3b": QWEN3_30B,
    "qwen3-235b-a22b": dict(QWEN3_30B, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                            moe_intermediate_size=1536, intermediate_size=12288),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, num_local_experts=8, num_experts_per_tok=2,
                         intermediate_size=14336, vocab_size=32000, rope_theta=1000000.0, max_position_embeddings=32768,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=2),
    "olmoe-1b-7b": dict(model_type="olmoe", hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, intermediate_size=1024,
                        vocab_size=50304, rope_theta=10000.0, max_position_embeddings=4096, rms_norm_eps=1e-5,
                        norm_topk_prob=False, tie_word_embeddings=False, eos_token_id=50279),
    "deepseek-v3": dict(model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                        intermediate_size=18432, vocab_size=129280, n_group=8, topk_group=4, n_shared_experts=1,
                        first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                        qk_nope_head_dim=128, v_head_dim=128, routed_scaling_factor=2.5, norm_topk_prob=True,
                        rope_theta=10000.0, max_position_embeddings=163840, rms_norm_eps=1e-6,
                        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, mscale=1.0,
                                          mscale_all_dim=1.0, beta_fast=32, beta_slow=1),
                        tie_word_embeddings=False, eos_token_id=1),
    # zai-org/GLM-4.5-Air's config.json (the MTP layer, num_nextn_predict_layers, is not part of the model run)
    "glm-4.5-air": dict(model_type="glm4_moe", hidden_size=4096, num_hidden_layers=46, num_attention_heads=96,
                        num_key_value_heads=8, head_dim=128, n_routed_experts=128, num_experts_per_tok=8,
                        moe_intermediate_size=1408, intermediate_size=10944, vocab_size=151552, n_group=1, topk_group=1,
                        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                        use_qk_norm=False, attention_bias=True, partial_rotary_factor=0.5, rope_theta=1000000.0,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                        eos_token_id=151329),
    "minimax-m2": dict(model_type="minimax_m2", hidden_size=3072, num_hidden_layers=62, num_attention_heads=48,
                       num_key_value_heads=8, head_dim=128, num_local_experts=256, num_experts_per_tok=8,
                       intermediate_size=1536, vocab_size=200064, rotary_dim=64, rope_theta=5000000.0,
                       max_position_embeddings=196608, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=200020),
    # openai/gpt-oss-20b's config.json (its layer_types alternate sliding and full from the first layer: the
    # family's default, left out so that --layers keeps working); experts in our 4-bit, or MXFP4 with --quant mxfp4
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                        experts_per_token=4, intermediate_size=2880, vocab_size=201088, sliding_window=128,
                        attention_bias=True, swiglu_limit=7.0, rope_theta=150000.0,
                        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                          original_max_position_embeddings=4096),
                        max_position_embeddings=131072, initial_context_length=4096, rms_norm_eps=1e-5,
                        tie_word_embeddings=False, eos_token_id=200002, pad_token_id=199999),
    # hybrid: three Gated DeltaNet layers before each gated full-attention layer, a gated shared expert
    "qwen3-next-80b-a3b": dict(model_type="qwen3_next", hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
                               num_key_value_heads=2, head_dim=256, num_experts=512, num_experts_per_tok=10,
                               moe_intermediate_size=512, shared_expert_intermediate_size=512, intermediate_size=5120,
                               vocab_size=151936, norm_topk_prob=True, full_attention_interval=4,
                               linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                               linear_num_key_heads=16, linear_num_value_heads=32, partial_rotary_factor=0.25,
                               rope_theta=10000000.0, max_position_embeddings=262144, rms_norm_eps=1e-6,
                               decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                               eos_token_id=151645),
    # the language model of a multimodal checkpoint: its settings under text_config
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe", tie_word_embeddings=False, text_config=dict(
        hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        vocab_size=248320, full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
        max_position_embeddings=262144, rms_norm_eps=1e-6, eos_token_id=248044)),
    # Gemma 4 26B-A4B's config.json (Gemma4ForConditionalGeneration; read from a public copy,
    # Danmoreng/gem16's tests/fixtures/gemma4_26b_config.json; its dimensions, rotary settings and shared
    # keys/values agree with AI-Hypercomputer/maxtext's src/maxtext/configs/models/gemma4-26b.yml).
    # Its layer_types, five sliding layers before each full one ending on a full one, are the family's
    # default, left out so that --layers keeps working (the last kept layer is full, as the family makes it).
    "gemma-4-26b-a4b": dict(model_type="gemma4", tie_word_embeddings=True, eos_token_id=[1, 106], text_config=dict(
        hidden_size=2816, num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        num_global_key_value_heads=2, global_head_dim=512, attention_k_eq_v=True, sliding_window=1024,
        intermediate_size=2112, enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
        vocab_size=262144, hidden_size_per_layer_input=0, vocab_size_per_layer_input=262144, num_kv_shared_layers=0,
        use_double_wide_mlp=False, use_bidirectional_attention="vision", hidden_activation="gelu_pytorch_tanh",
        attention_bias=False, rope_parameters=dict(
            full_attention=dict(rope_type="proportional", rope_theta=1000000.0, partial_rotary_factor=0.25),
            sliding_attention=dict(rope_type="default", rope_theta=10000.0)),
        final_logit_softcapping=30.0, max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=2, eos_token_id=1, pad_token_id=0)),
}
SHAPES["gpt-oss-120b"] = dict(SHAPES["gpt-oss-20b"], num_hidden_layers=36, num_local_experts=128)  # its config.json
BITS = {"q4": 4, "q8": 8, "none": None, mxfp4.MODE: 4}  # mxfp4: the resident matrices' bits
E2M1_RMS = math.sqrt(sum(v * v for v in mxfp4.E2M1) / 16)  # of a uniformly drawn code


class RandomWeights:
    """Random tensors already in stored form, so no quantization pass is needed."""

    def __init__(self, bits: int | None, group_size: int, seed: int, dtype=torch.bfloat16):
        self.bits, self.group_size, self.dtype = bits, group_size, dtype
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)  # random bytes for packed codes: fast, no float pass

    def matrix(self, name: str, out_f: int, in_f: int, *, std: float = 0.02, bits: int | None = -1) -> tuple[dict, QuantSpec]:
        bits = self.bits if bits == -1 else bits
        if bits is None or in_f % self.group_size:
            w = (torch.randn(out_f, in_f, generator=self.gen) * std).to(self.dtype)
            return {name: w}, QuantSpec()
        wshape, sshape = packed_shape(out_f, in_f, bits, self.group_size)
        raw = self.rng.bytes(wshape[0] * wshape[1] * 4)
        words = torch.frombuffer(bytearray(raw), dtype=torch.uint32).view(wshape)
        # codes uniform over the levels: scale so the weights have about `std` spread, centred on 0
        levels = (1 << bits) - 1
        scales = torch.full(sshape, std * 3.46 / levels).to(self.dtype)
        biases = (-scales.float() * levels / 2).to(self.dtype)
        base = name[: -len(".weight")]
        return {name: words, base + ".scales": scales, base + ".biases": biases}, QuantSpec(bits, self.group_size)

    def mxfp4_matrix(self, name: str, out_f: int, in_f: int, *, std: float = 0.02) -> tuple[dict, QuantSpec]:
        """An MXFP4 record's projection: random code bytes (every code equally likely) under the E8M0
        scale that gives the weights about `std` spread."""
        codes = torch.frombuffer(bytearray(self.rng.bytes(out_f * in_f // 2)), dtype=torch.uint8).view(out_f, in_f // 2)
        if in_f % mxfp4.VALUES_PER_BLOCK:
            raise MoestreamError(f"{name}: {in_f} inputs are not whole MXFP4 blocks of {mxfp4.VALUES_PER_BLOCK}")
        scale = 127 + round(math.log2(std / E2M1_RMS))  # E8M0: 2^(scale - 127)
        scales = torch.full((out_f, in_f // mxfp4.VALUES_PER_BLOCK), scale, dtype=torch.uint8)
        return {name: codes, name[: -len(".weight")] + ".scales": scales}, mxfp4.spec()

    def ones(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.ones(shape, dtype=self.dtype)


def _spread(family, name: str, bits: int | None) -> dict:
    """How a resident matrix is drawn: the bits the family's quant_predicate keeps for it, the
    embedding at unit spread, and the matrices the family keeps at more bits than the rest (routers
    and gates) wider, so random routing is not near-uniform; the others about 0.02."""
    spec = {"bits": None if bits is None else family.quant_predicate(name, bits)}
    if name == EMBEDDING:
        return {**spec, "std": 1.0}
    if family.quant_predicate(name, 4) != 4:
        return {**spec, "std": 0.5}
    return spec


def synth(shape: str, out: Path, *, layers: int | None = None, quant: str = "q4", group_size: int = 64,
          seed: int = 0, force: bool = False) -> Path:
    if shape not in SHAPES:
        raise MoestreamError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    cfg = dict(SHAPES[shape])
    text = cfg  # the language model's settings (a multimodal family's under text_config)
    if "text_config" in cfg:
        text = cfg["text_config"] = dict(cfg["text_config"])
    if layers is not None:
        if not 1 <= layers <= text["num_hidden_layers"]:
            raise MoestreamError(f"--layers {layers}: {shape} has layers 1..{text['num_hidden_layers']}")
        text["num_hidden_layers"] = layers
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise MoestreamError(f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise MoestreamError(f"{out} exists and is not empty (use --force to overwrite)")
        for stale in [*out.glob("experts-*.bin"), out / "moestream.json"]:  # a smaller model must not keep them
            stale.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    rw = RandomWeights(BITS[quant], group_size, seed)
    expert_matrix = rw.mxfp4_matrix if quant == mxfp4.MODE else rw.matrix
    family = family_module(cfg["model_type"])
    args = family.ModelArgs.from_dict(cfg)
    dense, specs = {}, {}
    for name, dims in weight_shapes(cfg["model_type"], cfg).items():  # what the family's model takes
        if len(dims) == 2:
            parts, spec = rw.matrix(name, *dims, **_spread(family, name, rw.bits))
            dense.update(parts)
            specs[name] = spec.to_json()
        else:  # norm weights 1, biases 0
            dense[name] = torch.zeros(dims, dtype=rw.dtype) if name.endswith(".bias") else rw.ones(dims)
            specs[name] = None
    expert_layers = []
    moe_layers, shapes = args.moe_layers(), args.expert_shapes()
    E = args.num_experts
    with tqdm(total=len(moe_layers) * E, desc=f"synth {shape}", unit="expert", file=sys.stderr) as bar:
        for i in moe_layers:
            writer = None
            for e in range(E):
                record, quant_specs = {}, {}
                for proj in EXPERT_PROJECTIONS:
                    parts, spec = expert_matrix(f"{proj}.weight", *shapes[proj])
                    record.update(parts)
                    quant_specs[proj] = spec
                if fused_layout(family).bias:  # the experts' biases, zero like the resident ones
                    record.update({f"{proj}.bias": torch.zeros(shapes[proj][0], dtype=rw.dtype) for proj in EXPERT_PROJECTIONS})
                quant_specs = with_activation(quant_specs, expert_activation(family), **activation_params(family, cfg))
                if writer is None:
                    writer = ExpertFileWriter(out / f"experts-{i:03d}.bin", i, E, record, quant_specs)
                writer.write(e, record)
                bar.update(1)
            expert_layers.append(writer.close())
    quantization = {"mode": "affine", "default_bits": BITS[quant], "group_size": group_size, "tensors": specs}
    finish_model(out, family=cfg["model_type"], config=cfg, source={"synthetic": shape, "seed": seed},
                 quantization=quantization, dense=dense, expert_layers=expert_layers, extra_files=[])
    return out
