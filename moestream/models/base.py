"""What every family shares: config reading, the strict weight loader and the stack builder."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from moestream.errors import FormatError
from moestream.format.reader import PackedModel
from moestream.layers.attention import Attention, AttentionWeights
from moestream.layers.moe import ExpertProvider, MoEBlock, SharedExpert
from moestream.layers.mlp import DenseMLP
from moestream.layers.rope import Rope, rope_theta
from moestream.layers.transformer import DecoderLayer, MoETransformer

# transformers 4 and 5 spell some fields differently; the first name is ModelArgs' field.
ALIASES = {"num_experts": ("num_local_experts",)}


@dataclass
class BaseModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    num_experts_per_tok: int
    num_experts: int
    rms_norm_eps: float = 1e-6
    head_dim: int | None = None
    intermediate_size: int | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    attention_bias: bool = False

    @classmethod
    def from_dict(cls, config: dict):
        values = dict(config)
        for name, others in ALIASES.items():
            for other in others:
                if values.get(name) is None and other in values:
                    values[name] = values[other]
        values["rope_theta"] = rope_theta(config)
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in values]
        if missing:
            raise FormatError(f"config.json lacks {', '.join(missing)} for a {cls.__module__.rsplit('.', 1)[-1]} model")
        args = cls(**{k: v for k, v in values.items() if k in names})
        if args.head_dim is None:
            args.head_dim = args.hidden_size // args.num_attention_heads
        return args


class WeightLoader:
    """Hands out resident tensors by name, checks shapes, and fails on missing or unused ones."""

    def __init__(self, packed: PackedModel, device: torch.device, dtype: torch.dtype):
        self.packed, self.device, self.dtype = packed, device, dtype
        self.unused = set(packed.logical_dense_names())

    def has(self, name: str) -> bool:
        return name in self.unused or name in self.packed.dense_names

    def take(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if not self.has(name):
            raise FormatError(f"{self.packed.directory}: weight {name!r} is missing")
        t = self.packed.dense(name, self.dtype)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise FormatError(f"{self.packed.directory}: weight {name!r} has shape {list(t.shape)}, config implies {list(shape)}")
        self.unused.discard(name)
        return t.to(self.device)

    def maybe(self, name: str, shape=None) -> torch.Tensor | None:
        return self.take(name, shape) if self.has(name) else None

    def finish(self) -> None:
        if self.unused:
            names = sorted(self.unused)
            raise FormatError(f"{self.packed.directory}: {len(names)} unused weights, e.g. {names[:3]}")


@dataclass
class FamilySpec:
    """What distinguishes a family when the stack is built."""

    moe_prefix: str = "mlp"  # Mixtral: block_sparse_moe
    qk_norm: str | None = None  # "head", "full" or None
    normalize_topk: bool = False
    float32_routing_weights: bool = False
    shared_expert: bool = False
    extra: dict = field(default_factory=dict)


def build_stack(args: BaseModelArgs, spec: FamilySpec, loader: WeightLoader, provider: ExpertProvider,
                is_moe_layer) -> MoETransformer:
    H, D = args.hidden_size, args.head_dim
    Nq, Nkv = args.num_attention_heads, args.num_key_value_heads
    layers = []
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        bias = args.attention_bias
        w = AttentionWeights(
            q=loader.take(p + "self_attn.q_proj.weight", (Nq * D, H)),
            k=loader.take(p + "self_attn.k_proj.weight", (Nkv * D, H)),
            v=loader.take(p + "self_attn.v_proj.weight", (Nkv * D, H)),
            o=loader.take(p + "self_attn.o_proj.weight", (H, Nq * D)),
            q_bias=loader.take(p + "self_attn.q_proj.bias") if bias else None,
            k_bias=loader.take(p + "self_attn.k_proj.bias") if bias else None,
            v_bias=loader.take(p + "self_attn.v_proj.bias") if bias else None,
        )
        w.fuse_qkv()
        if spec.qk_norm == "head":
            w.q_norm, w.k_norm = loader.take(p + "self_attn.q_norm.weight", (D,)), loader.take(p + "self_attn.k_norm.weight", (D,))
        elif spec.qk_norm == "full":
            w.q_norm = loader.take(p + "self_attn.q_norm.weight", (Nq * D,))
            w.k_norm = loader.take(p + "self_attn.k_norm.weight", (Nkv * D,))
        attn = Attention(w, num_heads=Nq, num_kv_heads=Nkv, head_dim=D, qk_norm=spec.qk_norm, eps=args.rms_norm_eps,
                         clip_qkv=spec.extra.get("clip_qkv"))
        if is_moe_layer(i):
            m = p + spec.moe_prefix + "."
            shared = None
            if spec.shared_expert:
                I_s = args.shared_expert_intermediate_size
                shared = SharedExpert(
                    gate=loader.take(m + "shared_expert.gate_proj.weight", (I_s, H)),
                    up=loader.take(m + "shared_expert.up_proj.weight", (I_s, H)),
                    down=loader.take(m + "shared_expert.down_proj.weight", (H, I_s)),
                    gate_weight=loader.take(m + "shared_expert_gate.weight", (1, H)))
            ffn = MoEBlock(i, loader.take(m + "gate.weight", (args.num_experts, H)), provider, top_k=args.num_experts_per_tok,
                           normalize_topk=spec.normalize_topk, float32_routing_weights=spec.float32_routing_weights,
                           shared=shared)
        else:
            I = args.intermediate_size
            g, u, d = (loader.take(p + f"mlp.{n}.weight", s) for n, s in
                       (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))))
            ffn = DenseMLP(g, u, d)
        layers.append(DecoderLayer(attn, ffn, loader.take(p + "input_layernorm.weight", (H,)),
                                   loader.take(p + "post_attention_layernorm.weight", (H,)), args.rms_norm_eps))
    embed = loader.take("model.embed_tokens.weight", (args.vocab_size, H))
    lm_head = loader.maybe("lm_head.weight", (args.vocab_size, H))
    if lm_head is None:
        if not args.tie_word_embeddings:
            raise FormatError(f"{loader.packed.directory}: lm_head.weight is missing and embeddings are not tied")
        lm_head = embed
    final_norm = loader.take("model.norm.weight", (H,))
    loader.finish()
    return MoETransformer(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head,
                          rope=Rope(D, args.rope_theta, loader.device), eps=args.rms_norm_eps,
                          num_kv_heads=Nkv, head_dim=D)
