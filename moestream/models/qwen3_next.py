"""Qwen3-Next: hybrid layers (`layer_types`, else every `full_attention_interval`-th layer full
attention, the others Gated DeltaNet linear attention), gated full attention (an output gate from
q_proj, per-head q/k norms, partial rotary), every RMSNorm zero-centered (scale 1 + w), MoE with a
shared expert behind a sigmoid gate (dense layers by mlp_only_layers / decoder_sparse_step),
softmax top-k routing renormalized if norm_topk_prob.

A linear-attention layer's cache is its recurrent state (LayerKV `state` / `conv`), kept for the
last steps and at snapshots (moestream.kv.recurrent). The checkpoint's
multi-token-prediction layers (`mtp.*`: fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers.J,
norm; see moestream.models.mtp) are built apart from the decoder by `build_mtp`; MTP layer J's
routed experts are expert layer num_hidden_layers + J."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from moestream.errors import UnsupportedModelError
from moestream.layers.experts import RoutedExperts
from moestream.layers.attention import Attention, AttentionWeights, offset_rms_norm
from moestream.layers.gated_deltanet import DeltaNetWeights, GatedDeltaNet
from moestream.layers.hybrid import HybridLayer, HybridTransformer
from moestream.kv.layout import LayerKV
from moestream.layers.mtp import MTPLayer
from moestream.layers.rope import Rope
from moestream.models import base

EXPERT_MODULE = "mlp"  # model.layers.N.mlp.experts.E.gate_proj.weight
EXPERT_NAMES = {p: p for p in base.EXPERT_PROJECTIONS}
FULL, LINEAR = "full_attention", "linear_attention"
DEFAULT_PARTIAL_ROTARY = 0.25  # transformers' default where config.json gives none
MTP = "mtp."  # the multi-token-prediction layers' names


@dataclass
class ModelArgs(base.BaseModelArgs):
    EXPERT_INTERMEDIATE: ClassVar[str] = "moe_intermediate_size"
    SPLIT_PROJECTIONS: ClassVar[bool] = False  # Qwen3.5: in_proj_qkv/z/b/a instead of in_proj_qkvz/ba
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    layer_types: list[str] = field(default_factory=list)
    full_attention_interval: int = 4
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    hidden_act: str = "silu"
    mtp_num_hidden_layers: int = 0  # multi-token-prediction layers (`mtp.layers.J`)

    @classmethod
    def from_dict(cls, config: dict):
        args = super().from_dict(config)
        family = config.get("model_type", "qwen3_next")
        if args.hidden_act != "silu":
            raise UnsupportedModelError(f"{family}: hidden_act {args.hidden_act!r} is not supported (silu)")
        if not args.rope_parameters.get("partial_rotary_factor"):
            args.rope_parameters["partial_rotary_factor"] = DEFAULT_PARTIAL_ROTARY
        L = args.num_hidden_layers
        if not args.layer_types:
            args.layer_types = [FULL if (i + 1) % args.full_attention_interval == 0 else LINEAR for i in range(L)]
        if len(args.layer_types) != L or any(t not in (FULL, LINEAR) for t in args.layer_types):
            raise UnsupportedModelError(f"{family}: layer_types must be {L} of {FULL!r} / {LINEAR!r}")
        if args.linear_num_value_heads % args.linear_num_key_heads:
            raise UnsupportedModelError(f"{family}: linear_num_value_heads must be a multiple of linear_num_key_heads")
        return args

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    def largest_intermediate(self) -> int:
        return max(super().largest_intermediate(), self.shared_expert_intermediate_size)

    def mtp_layer_count(self) -> int:
        return max(0, int(self.mtp_num_hidden_layers or 0))

    def is_mtp_weight(self, name: str) -> bool:
        return name.startswith(MTP)

    def expert_layer(self, prefix: str, layer: int) -> int:
        return self.num_hidden_layers + layer if prefix.startswith(MTP) else layer

    @property
    def conv_channels(self) -> int:
        """q, k and v of a linear-attention layer: the channels its convolution mixes."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    def kv_layout(self) -> list[LayerKV]:
        """Full-attention layers: K/V; linear-attention layers: a recurrent state and the convolution's history."""
        recurrent = LayerKV(0, 0, state=(self.linear_num_value_heads, self.linear_key_head_dim,
                                          self.linear_value_head_dim),
                            conv=(self.linear_conv_kernel_dim - 1, self.conv_channels))
        return [LayerKV(self.num_key_value_heads, self.head_dim) if t == FULL else recurrent for t in self.layer_types]


sanitize = base.sanitize  # checkpoint names kept (the multi-token-prediction layers' `mtp.*` too)
# the router, the shared expert's gate and the linear attention's beta/decay projections
quant_predicate = base.routers_keep_8_bits(".mlp.gate.weight", ".shared_expert_gate.weight", ".in_proj_ba.weight",
                                           ".in_proj_b.weight", ".in_proj_a.weight")


def offset_norm(loader, name: str, size: int) -> torch.Tensor:
    """A zero-centered norm weight as the scale it applies: 1 + w in float32."""
    return 1.0 + loader.take(name, (size,)).to(torch.float32)


def gated_attention(loader, prefix: str, args: ModelArgs, rope: Rope) -> Attention:
    """Full attention with an output gate: q_proj gives each head's query and gate side by side, the
    output is multiplied by sigmoid(gate) before o_proj; zero-centered per-head q/k norms."""
    H, D, Nq, Nkv = args.hidden_size, args.head_dim, args.num_attention_heads, args.num_key_value_heads
    w = AttentionWeights(q=loader.take(prefix + "q_proj.weight", (2 * Nq * D, H)),
                         k=loader.take(prefix + "k_proj.weight", (Nkv * D, H)),
                         v=loader.take(prefix + "v_proj.weight", (Nkv * D, H)),
                         o=loader.take(prefix + "o_proj.weight", (H, Nq * D)),
                         q_norm=offset_norm(loader, prefix + "q_norm.weight", D),
                         k_norm=offset_norm(loader, prefix + "k_norm.weight", D))
    w.fuse_qkv()
    return Attention(w, rope, num_heads=Nq, num_kv_heads=Nkv, head_dim=D, eps=args.rms_norm_eps, qk_norm="head",
                     norm=offset_rms_norm, gate=True)


def deltanet_projections(loader, prefix: str, args: ModelArgs):
    """(qkv, z, b, a) with q, k, v rows each for all heads in turn. Qwen3-Next fuses them per key
    head ([q, k, v, z] rows of a key head's group, then [b, a]); Qwen3.5 stores them apart."""
    H, Hk, Hv = args.hidden_size, args.linear_num_key_heads, args.linear_num_value_heads
    Dk, Dv, r = args.linear_key_head_dim, args.linear_value_head_dim, Hv // Hk
    if args.SPLIT_PROJECTIONS:
        return (loader.take(prefix + "in_proj_qkv.weight", (args.conv_channels, H)),
                loader.take(prefix + "in_proj_z.weight", (Hv * Dv, H)),
                loader.take(prefix + "in_proj_b.weight", (Hv, H)), loader.take(prefix + "in_proj_a.weight", (Hv, H)))
    qkvz = loader.take(prefix + "in_proj_qkvz.weight", (Hk * (2 * Dk + 2 * r * Dv), H)).view(Hk, -1, H)
    q, k, v, z = qkvz.split([Dk, Dk, r * Dv, r * Dv], dim=1)
    ba = loader.take(prefix + "in_proj_ba.weight", (2 * Hv, H)).view(Hk, 2 * r, H)
    b, a = ba.split([r, r], dim=1)
    qkv = torch.cat([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)])
    return qkv, z.reshape(-1, H).contiguous(), b.reshape(-1, H).contiguous(), a.reshape(-1, H).contiguous()


def deltanet(loader, prefix: str, args: ModelArgs) -> GatedDeltaNet:
    H, Hv, Dv, K = args.hidden_size, args.linear_num_value_heads, args.linear_value_head_dim, args.linear_conv_kernel_dim
    qkv, z, b, a = deltanet_projections(loader, prefix, args)
    w = DeltaNetWeights(qkv=qkv, z=z, b=b, a=a,
                        conv=loader.take(prefix + "conv1d.weight", (args.conv_channels, 1, K))[:, 0, :],
                        neg_a=-loader.take(prefix + "A_log", (Hv,)).to(torch.float32).exp(),
                        dt_bias=loader.take(prefix + "dt_bias", (Hv,)).to(torch.float32),
                        norm=loader.take(prefix + "norm.weight", (Dv,)),
                        out=loader.take(prefix + "out_proj.weight", (H, Hv * Dv)))
    return GatedDeltaNet(w, num_k_heads=args.linear_num_key_heads, num_v_heads=Hv, k_dim=args.linear_key_head_dim,
                         v_dim=Dv, eps=args.rms_norm_eps)


def build(args: ModelArgs, loader, experts: RoutedExperts) -> HybridTransformer:
    H, eps = args.hidden_size, args.rms_norm_eps
    rope = Rope.from_params(args.rope_parameters, args.head_dim, args.max_position_embeddings, loader.device)
    route = base.softmax_router(args, normalize=args.norm_topk_prob)
    layers = []
    for i, kind in enumerate(args.layer_types):
        p = f"model.layers.{i}."
        mixer = gated_attention(loader, p + "self_attn.", args, rope) if kind == FULL else \
            deltanet(loader, p + "linear_attn.", args)
        if args.is_moe_layer(i):
            ffn = base.gated_shared_moe(loader, p + "mlp.", i, args, route, experts)
        else:
            ffn = base.dense_mlp(loader, p + "mlp.", H, args.intermediate_size)
        layers.append(HybridLayer(mixer, ffn, offset_norm(loader, p + "input_layernorm.weight", H),
                                  offset_norm(loader, p + "post_attention_layernorm.weight", H), eps))
    embed, final_norm, lm_head = base.embeddings(loader, args)
    return HybridTransformer(embed=embed, layers=layers, final_norm=1.0 + final_norm.to(torch.float32),
                             lm_head=lm_head, rope=rope, eps=eps)


def build_mtp(args: ModelArgs, loader, experts: RoutedExperts, model: HybridTransformer, count: int) -> list[MTPLayer]:
    """The first `count` MTP layers: fc([pre_fc_norm_embedding(embed), pre_fc_norm_hidden(h)]), a
    full-attention MoE layer, norm, and the model's head (its embedding too, unless the checkpoint
    has the MTP's own); a chained step takes the normed state. Every norm is zero-centered."""
    H, eps = args.hidden_size, args.rms_norm_eps
    route = base.softmax_router(args, normalize=args.norm_topk_prob)
    embed = loader.take(MTP + "embed_tokens.weight", (args.vocab_size, H)) if loader.has(MTP + "embed_tokens.weight") \
        else model.embed_weight
    embed_norm, hidden_norm = (offset_norm(loader, MTP + n, H) for n in ("pre_fc_norm_embedding.weight",
                                                                          "pre_fc_norm_hidden.weight"))
    proj, final_norm = loader.take(MTP + "fc.weight", (H, 2 * H)), offset_norm(loader, MTP + "norm.weight", H)
    out = []
    for j in range(count):
        p, layer = f"{MTP}layers.{j}.", args.num_hidden_layers + j
        block = HybridLayer(gated_attention(loader, p + "self_attn.", args, model.rope),
                            base.gated_shared_moe(loader, p + "mlp.", layer, args, route, experts),
                            offset_norm(loader, p + "input_layernorm.weight", H),
                            offset_norm(loader, p + "post_attention_layernorm.weight", H), eps)
        out.append(MTPLayer(embed=embed, embed_norm=embed_norm, hidden_norm=hidden_norm, proj=proj, block=block,
                            final_norm=final_norm, head=model.lm_head,
                            kv=LayerKV(args.num_key_value_heads, args.head_dim), norm=offset_rms_norm, eps=eps,
                            chain_normed=True))
    return out
