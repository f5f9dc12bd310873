"""Tiny GGUF files written with the gguf package, laid out as llama.cpp's converter lays them out,
from the tiny Hugging Face checkpoints the tests build; each tensor in the GGUF type a test asks for.

Where gguf can quantize a type (F32, F16, BF16, Q8_0, Q4_0, MXFP4, ...) the checkpoint's values are
quantized with it. The K-quants it only dequantizes: their blocks are random bytes in the block
layout, with every fp16 scale (`d`, `dmin`) set to a small finite value, so the values are as sane as
a trained model's. Either way `encoded` keeps what was written, and `dequantized` is gguf's own
dequantization of those bytes: the values an import must give."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

import gguf
from tiny import load_all

T = gguf.GGMLQuantizationType
# the fp16 scale fields of each K-quant block: (byte offset, how large a value they allow)
# Q4_K/Q5_K: w = d·sc·q − dmin·m (sc, m 6-bit; q 4 or 5 bits); Q6_K: w = d·sc·(q − 32) (sc int8)
K_SCALES = {T.Q4_K: ((0, 0.3 / (63 * 15)), (2, 0.15 / 63)), T.Q5_K: ((0, 0.3 / (63 * 31)), (2, 0.15 / 63)),
            T.Q6_K: ((208, 0.3 / (128 * 32)),)}
QWEN3_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
EXPERT_STACKS = (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps"))


def can_quantize(qtype) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, 256), np.float32), qtype)
        return True
    except NotImplementedError:
        return False


def random_k_blocks(shape: tuple[int, ...], qtype, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks for a tensor of `shape` (numpy order), scales small and finite."""
    block_bytes = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
    raw = rng.integers(0, 256, size=block_bytes, dtype=np.uint8)
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    for offset, largest in K_SCALES[qtype]:
        d = (rng.uniform(0.5, 1.0, size=len(blocks)) * largest).astype(np.float16)
        blocks[:, offset:offset + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw


@dataclass
class Encoder:
    """Encodes each matrix in `qtype` (rows whose length is not a multiple of its block stay F32,
    as llama.cpp does); 1-D tensors and the router stay F32. Records what it wrote."""

    qtype: object
    seed: int = 0
    encoded: dict[str, object] = field(default_factory=dict)  # GGUF name -> its GGUF type
    dequantized: dict[str, np.ndarray] = field(default_factory=dict)  # GGUF name -> float32 values

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, name: str, values: np.ndarray) -> tuple[np.ndarray, object | None]:
        block = gguf.GGML_QUANT_SIZES[self.qtype][0]
        keep = values.ndim < 2 or ".ffn_gate_inp." in name or values.shape[-1] % block
        qtype = T.F32 if keep else self.qtype
        if qtype == T.F32:
            data = values.astype(np.float32)
        elif can_quantize(qtype):
            data = gguf.quants.quantize(values.astype(np.float32), qtype)
        else:
            data = random_k_blocks(values.shape, qtype, self.rng)
        self.encoded[name] = qtype
        self.dequantized[name] = np.asarray(gguf.quants.dequantize(data, qtype), np.float32).reshape(values.shape)
        return data, (None if qtype in (T.F32, T.F16) else qtype)


def add_tokenizer(w, hf_folder):
    """The folder's byte-level BPE as llama.cpp's converter writes it (model gpt2, merges, types)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {a.content for a in tok.get_added_tokens_decoder().values() if a.special}
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_chat_template(json.loads((hf_folder / "tokenizer_config.json").read_text())["chat_template"])


def finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_qwen3moe(hf_folder, path, *, encode, tokenizer: bool = False):
    """The checkpoint as llama.cpp's converter lays it out for arch qwen3moe (no q/k permutation);
    `encode(gguf_name, values)` gives each tensor's (data, raw_dtype)."""
    config = json.loads((hf_folder / "config.json").read_text())
    tensors = {k: v.float().numpy() for k, v in load_all(hf_folder).items()}
    a = "qwen3moe"
    w = gguf.GGUFWriter(str(path), a)
    experts = config.get("num_experts") or config["num_local_experts"]
    w.add_uint32(f"{a}.block_count", config["num_hidden_layers"])
    w.add_uint32(f"{a}.embedding_length", config["hidden_size"])
    w.add_uint32(f"{a}.feed_forward_length", config["intermediate_size"])
    w.add_uint32(f"{a}.expert_feed_forward_length", config["moe_intermediate_size"])
    w.add_uint32(f"{a}.attention.head_count", config["num_attention_heads"])
    w.add_uint32(f"{a}.attention.head_count_kv", config["num_key_value_heads"])
    w.add_uint32(f"{a}.attention.key_length", config["head_dim"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    w.add_float32(f"{a}.rope.freq_base", 10000.0)
    w.add_uint32(f"{a}.context_length", config["max_position_embeddings"])
    w.add_uint32(f"{a}.expert_count", experts)
    w.add_uint32(f"{a}.expert_used_count", config["num_experts_per_tok"])
    w.add_uint32("tokenizer.ggml.eos_token_id", config["eos_token_id"])
    if tokenizer:
        add_tokenizer(w, hf_folder)

    def add(name, values):
        data, raw_dtype = encode(name, values)
        w.add_tensor(name, data, raw_dtype=raw_dtype)

    add("token_embd.weight", tensors["model.embed_tokens.weight"])
    add("output_norm.weight", tensors["model.norm.weight"])
    add("output.weight", tensors["lm_head.weight"])
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        for hf, name in QWEN3_BLOCK.items():
            if prefix + hf + ".weight" in tensors:
                add(f"blk.{layer}.{name}.weight", tensors[prefix + hf + ".weight"])
        if prefix + "mlp.experts.0.gate_proj.weight" not in tensors:
            continue
        for proj, name in EXPERT_STACKS:
            add(f"blk.{layer}.{name}.weight", np.stack([tensors[f"{prefix}mlp.experts.{e}.{proj}.weight"] for e in range(experts)]))
    finish(w)
    return path


def experts_only(expert_type):
    """The encoding of the first GGUF tests: F32, expert stacks in `expert_type` (by gguf)."""
    def encode(name, values):
        if "_exps." not in name or expert_type == T.F32:
            return values.astype(np.float32), None
        return gguf.quants.quantize(values, expert_type), expert_type
    return encode


GPT_OSS_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}


def gpt_oss_stacks(tensors: dict[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    """transformers' gpt-oss experts (x @ W, gate and up interleaved) as llama.cpp splits them:
    ffn_{gate,up,down}_exps [E, out, in] and their biases [E, out]."""
    p = f"model.layers.{layer}.mlp.experts."
    gate_up = tensors[p + "gate_up_proj"].transpose(0, 2, 1)  # [E, 2I, H]
    bias = tensors[p + "gate_up_proj_bias"]
    return {"ffn_gate_exps.weight": gate_up[:, 0::2], "ffn_up_exps.weight": gate_up[:, 1::2],
            "ffn_down_exps.weight": tensors[p + "down_proj"].transpose(0, 2, 1), "ffn_gate_exps.bias": bias[:, 0::2],
            "ffn_up_exps.bias": bias[:, 1::2], "ffn_down_exps.bias": tensors[p + "down_proj_bias"]}


def write_gpt_oss(hf_folder, path, *, expert_type, fuse_gate_up: bool = False, swiglu_clamp: bool = False,
                  resident_type=T.F32):
    """The checkpoint as llama.cpp's converter lays out arch gpt-oss: F32, the expert matrices in
    `expert_type` (by gguf), gate and up as two stacks or, with fuse_gate_up, one (gate rows, then
    up); the SwiGLU limit written only with swiglu_clamp (llama.cpp's gpt-oss leaves it to its code).
    `resident_type`: the attention matrices, embeddings and head (as llama-quantize MXFP4_MOE writes
    them in Q8_0; the router stays F32, as llama.cpp keeps it).
    Returns {GGUF name: the float32 values the file holds} for the expert stacks."""
    config = json.loads((hf_folder / "config.json").read_text())
    rope = config.get("rope_parameters") or config["rope_scaling"]
    tensors = {k: v.float().numpy() for k, v in load_all(hf_folder).items()}
    a, L = "gpt-oss", config["num_hidden_layers"]
    w = gguf.GGUFWriter(str(path), a)
    w.add_uint32(f"{a}.block_count", L)
    w.add_uint32(f"{a}.context_length", config["max_position_embeddings"])
    w.add_uint32(f"{a}.embedding_length", config["hidden_size"])
    w.add_uint32(f"{a}.feed_forward_length", config["intermediate_size"])
    w.add_uint32(f"{a}.expert_feed_forward_length", config["intermediate_size"])
    w.add_uint32(f"{a}.attention.head_count", config["num_attention_heads"])
    w.add_uint32(f"{a}.attention.head_count_kv", config["num_key_value_heads"])
    w.add_uint32(f"{a}.attention.key_length", config["head_dim"])
    w.add_uint32(f"{a}.attention.value_length", config["head_dim"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    w.add_uint32(f"{a}.attention.sliding_window", config["sliding_window"])
    w.add_float32(f"{a}.rope.freq_base", rope["rope_theta"])
    w.add_string(f"{a}.rope.scaling.type", "yarn")
    w.add_float32(f"{a}.rope.scaling.factor", rope["factor"])
    w.add_uint32(f"{a}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
    w.add_uint32(f"{a}.expert_count", config["num_local_experts"])
    w.add_uint32(f"{a}.expert_used_count", config["num_experts_per_tok"])
    if swiglu_clamp:
        w.add_swiglu_clamp_exp([float(config["swiglu_limit"])] * L)
    w.add_uint32("tokenizer.ggml.eos_token_id", config["eos_token_id"])
    add_tokenizer(w, hf_folder)

    def add_resident(name, values):
        if values.ndim == 2 and resident_type != T.F32 and ".ffn_gate_inp." not in name:
            w.add_tensor(name, gguf.quants.quantize(values, resident_type), raw_dtype=resident_type)
        else:
            w.add_tensor(name, values)

    add_resident("token_embd.weight", tensors["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", tensors["model.norm.weight"])
    add_resident("output.weight", tensors["lm_head.weight"])
    held = {}
    for layer in range(L):
        prefix = f"model.layers.{layer}."
        for hf, name in GPT_OSS_BLOCK.items():
            for kind in ("weight", "bias"):
                if prefix + hf + "." + kind in tensors:
                    add_resident(f"blk.{layer}.{name}.{kind}", tensors[prefix + hf + "." + kind])
        w.add_tensor(f"blk.{layer}.attn_sinks.weight", tensors[prefix + "self_attn.sinks"])
        stacks = gpt_oss_stacks(tensors, layer)
        if fuse_gate_up:
            for kind, axis in (("weight", 1), ("bias", 1)):
                gate, up = stacks.pop(f"ffn_gate_exps.{kind}"), stacks.pop(f"ffn_up_exps.{kind}")
                stacks[f"ffn_gate_up_exps.{kind}"] = np.concatenate([gate, up], axis=axis)
        for name, values in stacks.items():
            values = np.ascontiguousarray(values, np.float32)
            if name.endswith(".weight") and expert_type != T.F32:
                data = gguf.quants.quantize(values, expert_type)
                held[f"blk.{layer}.{name}"] = gguf.quants.dequantize(data, expert_type).reshape(values.shape)
                w.add_tensor(f"blk.{layer}.{name}", data, raw_dtype=expert_type)
            else:
                held[f"blk.{layer}.{name}"] = values
                w.add_tensor(f"blk.{layer}.{name}", values)
    finish(w)
    return held
