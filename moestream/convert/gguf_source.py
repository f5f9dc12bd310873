"""A GGUF file read as a Hugging Face checkpoint: config.json from its metadata, tensors under
transformers' names, dequantized exactly by the gguf package (F16 and BF16 tensors in their own
dtype, the rest as float32).

Expert stacks (`blk.N.ffn_{gate,up,down}_exps`, [E, out, in]) are offered as per-expert tensors,
one expert dequantized at a time. llama.cpp stores the q and k projections of "llama"-arch models
(Mixtral) with the rotary halves interleaved; they are permuted back. The other MoE archs are
stored unpermuted. gpt-oss (arch `gpt-oss`) is offered as transformers stores it: fused expert
stacks for x @ W with gate and up rows interleaved, and their biases, built from llama.cpp's
separate (or gate-then-up fused) stacks one expert at a time; where they are MXFP4, `mxfp4_rows`
gives their codes and scales as they are (re-ordered to the Hub's layout), so convert keeps them.
`source_plan` says how convert stores each tensor by default (moestream.quant.ggml: the type's codes
where our affine layout holds them exactly, read by `affine_rows`; else no fewer bits); `--quant`
instead dequantizes and quantizes again. Without a tokenizer folder, the tokenizer and chat template
come from the metadata (gguf_tokenizer.py)."""
from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path

import numpy as np
import torch

from moestream.models.registry import family_module
from moestream.convert.gguf_tokenizer import tokenizer_from_metadata, write_files
from moestream.convert.source import TOKENIZER_FILES, CheckpointError, CheckpointSource
from moestream.errors import UnsupportedModelError
from moestream.format.safetensors_io import TensorInfo
from moestream.format.writer import sha256_file
from moestream.quant import mxfp4

log = logging.getLogger(__name__)

ARCH_FAMILY = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "olmoe": "olmoe", "llama": "mixtral",
               "gpt-oss": "gpt_oss"}
TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
         "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
         "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
         "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
         "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# gpt-oss: what differs from BLOCK (the router is `mlp.router`, a norm after attention, sink logits)
GPT_OSS_BLOCK = {**BLOCK, "ffn_gate_inp": "mlp.router", "post_attention_norm": "post_attention_layernorm",
                 "attn_sinks": "self_attn.sinks"}
GPT_OSS_STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")
# gpt-oss settings llama.cpp does not write (its own code holds them): the released configs' values
GPT_OSS_SWIGLU_LIMIT, GPT_OSS_YARN = 7.0, {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
MIXTRAL_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
HALF_TYPES = {"F16": torch.float16, "BF16": torch.bfloat16}  # offered in their own dtype (exactly), the rest as float32
BLOCK_NAME = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<what>[a-z_]+)\.(?P<kind>weight|bias)$")


class GgufSource(CheckpointSource):
    """CheckpointSource's interface over one .gguf file (tokenizer files from `tokenizer`, a folder)."""

    def __init__(self, path: str | Path, *, tokenizer: str | Path | None = None):
        import gguf

        self.folder = Path(path)  # OUT must not be this file or contain it
        self.origin = {"path": str(self.folder.resolve()), "format": "gguf"}
        try:
            self.reader = gguf.GGUFReader(self.folder)
        except (ValueError, OSError, IndexError) as exc:
            raise CheckpointError(f"{self.folder}: not a readable GGUF file ({exc})") from None
        self.arch = self._str("general.architecture")
        family = ARCH_FAMILY.get(self.arch)
        if family is None or (self.arch == "llama" and not self._int(f"{self.arch}.expert_count", 0)):
            raise UnsupportedModelError(f"{self.folder}: GGUF architecture {self.arch!r} is not a supported MoE "
                                        f"(supported: {', '.join(ARCH_FAMILY)} with experts)")
        # GGUF types: dequantized by the gguf package
        self.family, self.mlx, self.imported, self.fp8, self.mxfp4 = family, None, None, None, False
        self.family_module = family_module(family)
        self.tokenizer_dir = Path(tokenizer) if tokenizer is not None else None
        self._scratch = None  # where the metadata's tokenizer is written for convert to copy
        if self.tokenizer_dir is not None and not self.tokenizer_dir.is_dir():
            raise CheckpointError(f"{self.tokenizer_dir}: --tokenizer must be a folder with tokenizer.json")
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.files = [self.folder.name]
        self._handles = {}
        self.index, self._virtual = {}, {}
        self._fused: dict[str, tuple[str, tuple[str, ...]]] = {}  # gpt-oss stacks: name -> (kind, GGUF names)
        self._map_names()
        self.config = self._config()
        self.packed_names = {name: name for name in self.index}  # transformers' names already

    # -- metadata ----------------------------------------------------------------
    def _field(self, key: str):
        field = self.reader.fields.get(key)
        return None if field is None else field.contents()

    def _str(self, key: str) -> str:
        value = self._field(key)
        if not isinstance(value, str):
            raise CheckpointError(f"{self.folder}: GGUF metadata {key} is missing")
        return value

    def _int(self, key: str, default: int | None = None) -> int:
        value = self._field(key)
        if value is None:
            if default is None:
                raise CheckpointError(f"{self.folder}: GGUF metadata {key} is missing")
            return default
        return int(value)

    def _config(self) -> dict:
        a = self.arch
        hidden = self._int(f"{a}.embedding_length")
        heads = self._int(f"{a}.attention.head_count")
        moe_layers = sorted({int(m["layer"]) for n in self.tensors if (m := BLOCK_NAME.match(n)) and m["what"] == "ffn_gate_exps"})
        layers = self._int(f"{a}.block_count")
        config = {"model_type": self.family, "architectures": [], "hidden_size": hidden, "num_hidden_layers": layers,
                  "num_attention_heads": heads, "num_key_value_heads": self._int(f"{a}.attention.head_count_kv", heads),
                  "head_dim": self._int(f"{a}.attention.key_length", hidden // heads),
                  "rms_norm_eps": float(self._field(f"{a}.attention.layer_norm_rms_epsilon") or 1e-6),
                  "rope_theta": float(self._field(f"{a}.rope.freq_base") or 10000.0),
                  "max_position_embeddings": self._int(f"{a}.context_length", 4096),
                  "vocab_size": int(self.tensors["token_embd.weight"].shape[1]),
                  "num_experts_per_tok": self._int(f"{a}.expert_used_count"),
                  "tie_word_embeddings": "output.weight" not in self.tensors}
        experts = self._int(f"{a}.expert_count")
        dense_ff = self._int(f"{a}.feed_forward_length", 0)
        expert_ff = self._int(f"{a}.expert_feed_forward_length", 0) or dense_ff
        if self.family == "mixtral":
            config.update(num_local_experts=experts, intermediate_size=expert_ff)
        elif self.family == "gpt_oss":
            config.update(self._gpt_oss_config(layers), num_local_experts=experts, intermediate_size=expert_ff)
        elif self.family == "olmoe":
            config.update(num_experts=experts, intermediate_size=expert_ff, norm_topk_prob=False)
        else:
            config.update(num_experts=experts, moe_intermediate_size=expert_ff, intermediate_size=dense_ff or expert_ff,
                          decoder_sparse_step=1, mlp_only_layers=[i for i in range(layers) if i not in moe_layers],
                          norm_topk_prob=self.family == "qwen3_moe")
            if self.family == "qwen2_moe":
                config["shared_expert_intermediate_size"] = self._int(f"{a}.expert_shared_feed_forward_length", dense_ff)
        for key, gguf_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
            if self._field(gguf_key) is not None:
                config[key] = int(self._field(gguf_key))
        return config

    def _gpt_oss_config(self, layers: int) -> dict:
        """Sliding and full layers, YaRN and the SwiGLU clamp as transformers' GptOssConfig names them."""
        a = self.arch
        pattern = self._field(f"{a}.attention.sliding_window_pattern")
        if isinstance(pattern, list) and len(pattern) == layers:  # true: a sliding layer
            sliding = [bool(p) for p in pattern]
        else:  # llama.cpp's gpt-oss: every other layer, the first one sliding
            sliding = [i % 2 == 0 for i in range(layers)]
        config = {"attention_bias": True, "sliding_window": self._int(f"{a}.attention.sliding_window"),
                  "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}
        limits = self._field(f"{a}.swiglu_clamp_exp")
        limits = set(limits) if isinstance(limits, list) else {GPT_OSS_SWIGLU_LIMIT}
        if len(limits) != 1:
            raise UnsupportedModelError(f"{self.folder}: {a}.swiglu_clamp_exp differs between layers ({sorted(limits)})")
        config["swiglu_limit"] = float(limits.pop())
        if self._field(f"{a}.rope.scaling.type") == "yarn":
            yarn = {"rope_type": "yarn", **GPT_OSS_YARN,
                    "factor": float(self._field(f"{a}.rope.scaling.factor")),
                    "original_max_position_embeddings": self._int(f"{a}.rope.scaling.original_context_length")}
            for key in ("beta_fast", "beta_slow"):
                if self._field(f"{a}.rope.scaling.yarn_{key}") is not None:
                    yarn[key] = float(self._field(f"{a}.rope.scaling.yarn_{key}"))
            config["rope_scaling"] = yarn
        return config

    # -- tensors -------------------------------------------------------------------
    def _map_names(self) -> None:
        block = GPT_OSS_BLOCK if self.family == "gpt_oss" else BLOCK
        for name, t in self.tensors.items():
            if name in TOP:
                self._add(TOP[name], name, None)
                continue
            m = BLOCK_NAME.match(name)
            if m is None:
                raise CheckpointError(f"{self.folder}: GGUF tensor {name} is not one moestream maps")
            layer, what, kind = int(m["layer"]), m["what"], m["kind"]
            prefix = f"model.layers.{layer}"
            if self.family == "gpt_oss" and what in GPT_OSS_STACKS:
                continue  # fused below, once each layer's stacks are all known
            if what == "attn_sinks":
                self._add(f"{prefix}.{block[what]}", name, None)
            elif what in EXPERT_STACKS and kind == "weight":
                proj = EXPERT_STACKS[what]
                moe = "block_sparse_moe" if self.family == "mixtral" else "mlp"
                proj_name = MIXTRAL_PROJ[proj] if self.family == "mixtral" else proj
                for e in range(int(t.shape[2])):
                    self._add(f"{prefix}.{moe}.experts.{e}.{proj_name}.weight", name, e)
            elif what in block:
                target = block[what]
                if self.family == "mixtral" and target == "mlp.gate":
                    target = "block_sparse_moe.gate"
                self._add(f"{prefix}.{target}.{kind}", name, None)
            else:
                raise CheckpointError(f"{self.folder}: GGUF tensor {name} is not one moestream maps")
        if self.family == "gpt_oss":
            self._map_gpt_oss_stacks()

    def _map_gpt_oss_stacks(self) -> None:
        """transformers' gpt-oss stacks (x @ W, gate and up rows interleaved) over llama.cpp's:
        gate_up_proj [E, H, 2I], down_proj [E, I, H], gate_up_proj_bias [E, 2I], down_proj_bias [E, H]."""
        layers = sorted({int(m["layer"]) for n in self.tensors if (m := BLOCK_NAME.match(n)) and m["what"] in GPT_OSS_STACKS})
        for layer in layers:
            blk, prefix = f"blk.{layer}", f"model.layers.{layer}.mlp.experts"
            for kind in ("weight", "bias"):
                fused = f"{blk}.ffn_gate_up_exps.{kind}"
                parts = (fused,) if fused in self.tensors else (f"{blk}.ffn_gate_exps.{kind}", f"{blk}.ffn_up_exps.{kind}")
                down = f"{blk}.ffn_down_exps.{kind}"
                for part in (*parts, down):
                    if part not in self.tensors:
                        raise CheckpointError(f"{self.folder}: GGUF tensor {part} is missing (gpt-oss experts)")
                suffix = "" if kind == "weight" else "_bias"
                self._add_fused(f"{prefix}.gate_up_proj{suffix}", "gate_up", parts)
                self._add_fused(f"{prefix}.down_proj{suffix}", "down", (down,))

    def _add_fused(self, hf_name: str, kind: str, parts: tuple[str, ...]) -> None:
        shapes = [tuple(int(d) for d in reversed(self.tensors[p].shape.tolist())) for p in parts]
        E, rows = shapes[0][0], sum(s[1] for s in shapes)  # [E, out(, in)] each
        shape = (E, rows) if len(shapes[0]) == 2 else (E, shapes[0][2], rows)  # matrices transposed: x @ W
        self._fused[hf_name] = (kind, parts)
        self.index[hf_name] = self.folder.name
        self._virtual[hf_name] = (parts[0], None, TensorInfo(hf_name, "F32", shape, -1, 4 * int(np.prod(shape))))

    def _add(self, hf_name: str, gguf_name: str, expert: int | None) -> None:
        t = self.tensors[gguf_name]
        # GGUF lists dimensions fastest first; numpy order is the reverse ([out, in] for a matrix)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if expert is not None:
            shape = shape[1:]
        if hf_name.endswith("mlp.shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, shape[0])
        self.index[hf_name] = self.folder.name
        dtype = t.tensor_type.name if t.tensor_type.name in HALF_TYPES else "F32"  # 16-bit floats stay 16-bit
        size = (2 if dtype in HALF_TYPES else 4) * int(np.prod(shape))
        self._virtual[hf_name] = (gguf_name, expert, TensorInfo(hf_name, dtype, shape, -1, size))

    def info(self, name: str) -> TensorInfo:
        return self._virtual[name][2]

    def get(self, name: str) -> torch.Tensor:
        gguf_name, expert, info = self._virtual[name]
        if name in self._fused:
            return self.get_rows(name, 0, info.shape[0])
        out = self._dequantize(gguf_name, expert).reshape(info.shape).to(HALF_TYPES.get(info.dtype, torch.float32))
        if self.arch == "llama" and gguf_name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = self.config["num_attention_heads" if ".attn_q." in gguf_name else "num_key_value_heads"]
            out = unpermute(out, heads)
        return out

    def get_rows(self, name: str, start: int, count: int = 1) -> torch.Tensor:
        if name not in self._fused:
            return self.get(name)[start:start + count]
        kind, parts = self._fused[name]
        stacks = [self._dequantize(p, slice(start, start + count)) for p in parts]  # [n, out(, in)] each
        if kind == "down":
            return stacks[0].transpose(1, 2).contiguous() if stacks[0].dim() == 3 else stacks[0]
        gate, up = stacks if len(stacks) == 2 else stacks[0].chunk(2, dim=1)  # llama.cpp's fused: gate rows, then up
        rows = torch.stack((gate, up), dim=2).flatten(1, 2)  # rows interleaved: gate 0, up 0, gate 1, ...
        return rows.transpose(1, 2).contiguous() if rows.dim() == 3 else rows

    def mxfp4_stack(self, name: str) -> bool:
        """Whether the fused stack `name` (weights, not biases) is built only from MXFP4 GGUF tensors."""
        import gguf

        fused = self._fused.get(name)
        return (fused is not None and len(self._virtual[name][2].shape) == 3
                and all(self.tensors[p].tensor_type == gguf.GGMLQuantizationType.MXFP4 for p in fused[1]))

    def mxfp4_rows(self, name: str, start: int, count: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts start.. of an MXFP4 stack as the Hub stores them (blocks uint8 [n, Out, G, 16], scales
        uint8 [n, Out, G], gate and up rows interleaved): the file's codes and scales, re-ordered only."""
        kind, parts = self._fused[name]
        pieces = []
        for part in parts:
            raw = torch.from_numpy(np.array(self.tensors[part].data[start:start + count], dtype=np.uint8))  # a copy
            blocks, scales = mxfp4.from_ggml(raw)  # [n, out, G, 16], [n, out, G]
            mxfp4.check_scales(part, scales, start)
            pieces.append((blocks, scales))
        if kind == "down":
            return pieces[0]
        if len(pieces) == 1:  # llama.cpp's fused: gate rows, then up
            pieces = list(zip(*(t.chunk(2, dim=1) for t in pieces[0])))
        (gate_b, gate_s), (up_b, up_s) = pieces
        return (torch.stack((gate_b, up_b), dim=2).flatten(1, 2).contiguous(),  # gate 0, up 0, gate 1, ...
                torch.stack((gate_s, up_s), dim=2).flatten(1, 2).contiguous())

    def source_plan(self, name: str):
        """How convert stores `name` by default (moestream.quant.ggml.SourcePlan): its GGUF type's exact
        affine form, float, or 8 bits. Fused gpt-oss stacks are rebuilt from rows, so their codes are not kept."""
        import dataclasses

        from moestream.quant import ggml

        gguf_name, expert, info = self._virtual[name]
        parts = self._fused[name][1] if name in self._fused else (gguf_name,)
        types = sorted({self.tensors[p].tensor_type.name for p in parts})
        dims = len(self.tensors[gguf_name].shape) - (expert is not None)
        if len(types) > 1:  # gate and up stacks of two types: one record part, as the finer one needs
            mixed = ggml.plan("+".join(types), info.shape)
            return mixed if any(t not in ggml.FLOAT_TYPES for t in types) else ggml.plan("F32", info.shape)
        plan = ggml.plan(types[0], info.shape if dims >= 2 else (int(np.prod(info.shape)),))
        return dataclasses.replace(plan, kept=False) if name in self._fused and plan.spec.quantized else plan

    def affine_rows(self, name: str, start: int, count: int) -> dict[str, torch.Tensor]:
        """Rows start.. of a tensor whose source_plan keeps its codes, as affine record parts
        {weight, scales, biases} holding the file's codes and block scales (moestream.quant.ggml)."""
        from moestream.quant import ggml

        gguf_name, expert, info = self._virtual[name]
        t = self.tensors[gguf_name]
        data = t.data if expert is None else t.data[expert]
        permuted = self.arch == "llama" and gguf_name.endswith((".attn_q.weight", ".attn_k.weight"))
        rows = slice(None) if permuted else slice(start, start + count)  # the permutation needs every row
        parts = ggml.affine_parts(t.tensor_type.name, torch.from_numpy(np.array(data[rows], dtype=np.uint8)),
                                  name=f"{self.folder}: {gguf_name}")
        if permuted:
            heads = self.config["num_attention_heads" if ".attn_q." in gguf_name else "num_key_value_heads"]
            parts = {k: unpermute(v, heads)[start:start + count].contiguous() for k, v in parts.items()}
        return parts

    def _dequantize(self, gguf_name: str, experts: int | slice | None) -> torch.Tensor:
        """A GGUF tensor (or some experts of a stack) in float32 [.., out, in], by gguf's own code."""
        import gguf

        t = self.tensors[gguf_name]
        data = t.data if experts is None else t.data[experts]
        values = gguf.quants.dequantize(np.asarray(data), t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if isinstance(experts, slice):
            shape = (len(range(*experts.indices(shape[0]))), *shape[1:])
        elif experts is not None:
            shape = shape[1:]
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)  # a copy: not the file's pages

    # -- other files ---------------------------------------------------------------
    def tokenizer_files(self) -> list[Path]:
        """The --tokenizer folder's files, else tokenizer.json and tokenizer_config.json built from
        the metadata (in a private temporary folder, removed at close)."""
        if self.tokenizer_dir is not None:
            return [self.tokenizer_dir / n for n in TOKENIZER_FILES if (self.tokenizer_dir / n).is_file()]
        built = tokenizer_from_metadata(self._field)
        if built is None:
            return []
        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="moestream-gguf-tokenizer-")
        return write_files(Path(self._scratch.name), built)

    def file_sizes(self) -> dict[str, int]:
        return {self.folder.name: self.folder.stat().st_size}

    def file_hash(self, name: str) -> str:
        return sha256_file(self.folder)

    def close(self) -> None:
        self.tensors.clear()
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order for llama-arch models (rotary halves interleaved per head)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
