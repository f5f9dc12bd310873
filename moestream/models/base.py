"""What every family shares: config reading, the strict weight loader, and builders for the usual
pieces (a family file holds what differs: moestream.models.registry)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from moestream.errors import FormatError
from moestream.layers.attention import Attention, AttentionWeights
from moestream.kv.layout import LayerKV
from moestream.layers.mlp import DenseMLP
from moestream.layers.moe import MoEBlock, SharedExpert
from moestream.layers.packed_matrix import packed_matrix, packs
from moestream.layers.rope import Rope, rope_parameters, rope_theta
from moestream.layers.routers import softmax_topk
from moestream.layers.transformer import DecoderLayer, MoETransformer

# transformers 4 and 5 spell some fields differently; the first name is ModelArgs' field.
ALIASES = {"num_experts": ("num_local_experts", "n_routed_experts")}
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
EMBEDDING = "model.embed_tokens.weight"  # the token embedding `embeddings` takes


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
    rope_parameters: dict = field(default_factory=dict)  # every rotary setting (moestream.layers.rope)
    # the config field sizing routed experts (named in convert's messages about expert shapes)
    EXPERT_INTERMEDIATE: ClassVar[str] = "intermediate_size"
    ROPE_TYPES: ClassVar[tuple[str, ...]] = ("default",)  # the rope types the family's build computes

    @classmethod
    def from_dict(cls, config: dict):
        values = dict(config)
        for name, others in ALIASES.items():
            for other in others:
                if values.get(name) is None and other in values:
                    values[name] = values[other]
        values["rope_theta"] = rope_theta(config, supported=cls.ROPE_TYPES)
        values["rope_parameters"] = rope_parameters(config)
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in values]
        if missing:
            raise FormatError(f"config.json lacks {', '.join(missing)} for a {cls.__module__.rsplit('.', 1)[-1]} model")
        args = cls(**{k: v for k, v in values.items() if k in names})
        if args.head_dim is None:
            args.head_dim = args.hidden_size // args.num_attention_heads
        return args

    @staticmethod
    def config_key(config: dict, field: str) -> str:
        """How config.json spells a field (transformers 4 and 5 differ for some)."""
        return next((k for k in (field, *ALIASES.get(field, ())) if config.get(k) is not None), field)

    # -- what the rest of the project asks (a family overrides where it differs) ---------------
    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0

    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def expert_intermediate_size(self) -> int:
        """The routed experts' intermediate size."""
        return getattr(self, self.EXPERT_INTERMEDIATE)

    def largest_intermediate(self) -> int:
        """The widest FFN intermediate any layer computes (sizes the engine's workspace)."""
        return max(self.intermediate_size or 0, self.expert_intermediate_size or 0)

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        """[out, in] of each projection of one routed expert."""
        H, I = self.hidden_size, self.expert_intermediate_size
        return {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}

    def expanded_kv_width(self) -> int:
        """Per query head, the key + value values prefill attention expands the cache to (0 where it
        reads the cache as it is: one KV head per query head)."""
        if self.num_attention_heads == self.num_key_value_heads:
            return 0
        return 2 * self.head_dim

    def kv_layout(self) -> list[LayerKV]:
        """Each layer's KV cache (moestream.kv.layout): here every layer full attention, one shape."""
        return [LayerKV(self.num_key_value_heads, self.head_dim)] * self.num_hidden_layers

    # -- multi-token prediction (moestream.models.mtp; a family with MTP layers overrides these) --
    def mtp_layer_count(self) -> int:
        """How many multi-token-prediction layers config.json declares (0: the family has none)."""
        return 0

    def is_mtp_weight(self, name: str) -> bool:
        """Whether a packed tensor name belongs to a multi-token-prediction layer."""
        return False

    def expert_layer(self, prefix: str, layer: int) -> int:
        """The expert layer index of routed experts under `prefix` (`...layers.<layer>.mlp`): the
        layer itself; MTP layer j's experts are expert layer num_hidden_layers + j."""
        return layer

    def mtp_expert_layers(self, count: int) -> list[int]:
        """The expert layer indices of `count` MTP layers (each has routed experts)."""
        return [self.num_hidden_layers + j for j in range(count)]


class WeightLoader:
    """Hands out resident tensors by name, checks shapes, and fails on missing or unused ones."""

    def __init__(self, packed, device: torch.device, dtype: torch.dtype):
        self.packed, self.device, self.dtype = packed, device, dtype
        self.unused = set(packed.logical_dense_names())

    def has(self, name: str) -> bool:
        return name in self.unused or name in self.packed.dense_names

    def take(self, name: str, shape: tuple[int, ...], *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor in the model's dtype, or in `dtype` (a resident vector kept in float32)."""
        if not self.has(name):
            raise FormatError(f"{self.packed.directory}: weight {name!r} is missing")
        t = self.packed.dense(name, dtype or self.dtype)
        if tuple(t.shape) != tuple(shape):
            raise FormatError(f"{self.packed.directory}: weight {name!r} has shape {list(t.shape)}, config implies {list(shape)}")
        self.unused.discard(name)
        return t.to(self.device)

    def take_matrix(self, name: str, shape: tuple[int, int]) -> torch.Tensor:
        """A matrix the layers only multiply by (F.linear) or gather rows of: kept packed where the
        kernels take its codes (moestream.layers.packed_matrix), else as `take` gives it."""
        spec = self.packed.tensor_spec(name) if self.has(name) else None
        if spec is None or not spec.quantized:
            return self.take(name, shape)
        base = name[: -len(".weight")]
        scales = self.packed.raw_dense(base + ".scales")
        if not packs(spec, shape, scales.dtype, self.device, self.dtype):
            return self.take(name, shape)
        m = packed_matrix(*(self.packed.raw_dense(n).to(self.device) for n in (name, base + ".scales", base + ".biases")),
                          spec, self.dtype)
        if tuple(m.shape) != tuple(shape):
            raise FormatError(f"{self.packed.directory}: weight {name!r} has shape {list(m.shape)}, config implies {list(shape)}")
        self.unused.discard(name)
        return m

    def finish(self) -> None:
        if self.unused:
            names = sorted(self.unused)
            raise FormatError(f"{self.packed.directory}: {len(names)} unused weights, e.g. {names[:3]}")


class ShapeRecorder:
    """A loader that records what `build` takes (name -> shape) and hands out meta tensors: the
    family's build is the one list of its resident tensors (synth, the memory ledger and convert
    ask it). `present`: the names a checkpoint has, for tensors a build takes only if present
    (an untied lm_head beside tie_word_embeddings)."""

    def __init__(self, present=()):
        self.device, self.dtype = torch.device("meta"), torch.float32
        self.present = frozenset(present)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.matrices: set[str] = set()  # the names taken by take_matrix

    def has(self, name: str) -> bool:
        return name in self.present

    def take(self, name: str, shape: tuple[int, ...], *, dtype: torch.dtype | None = None) -> torch.Tensor:
        self.shapes[name] = tuple(shape)
        return torch.empty(shape, device="meta")

    def take_matrix(self, name: str, shape: tuple[int, int]) -> torch.Tensor:
        self.matrices.add(name)
        return self.take(name, shape)

    def finish(self) -> None:
        pass


# -- builders for the pieces most families share ------------------------------------------------

def attention(loader, prefix: str, args: BaseModelArgs, rope: Rope, *, bias: bool = False, qk_norm: str | None = None,
              clip_qkv: float | None = None) -> Attention:
    """GQA self-attention from `{prefix}q_proj` ... `o_proj`; qk_norm "head" ([D] weights), "full"
    ([Nq*D] / [Nkv*D] weights) or None."""
    H, D, Nq, Nkv = args.hidden_size, args.head_dim, args.num_attention_heads, args.num_key_value_heads
    w = AttentionWeights(
        q=loader.take_matrix(prefix + "q_proj.weight", (Nq * D, H)),
        k=loader.take_matrix(prefix + "k_proj.weight", (Nkv * D, H)),
        v=loader.take_matrix(prefix + "v_proj.weight", (Nkv * D, H)),
        o=loader.take_matrix(prefix + "o_proj.weight", (H, Nq * D)))
    if bias:
        w.q_bias = loader.take(prefix + "q_proj.bias", (Nq * D,))
        w.k_bias = loader.take(prefix + "k_proj.bias", (Nkv * D,))
        w.v_bias = loader.take(prefix + "v_proj.bias", (Nkv * D,))
    w.fuse_qkv()
    if qk_norm is not None:
        q_size, k_size = (D, D) if qk_norm == "head" else (Nq * D, Nkv * D)
        w.q_norm = loader.take(prefix + "q_norm.weight", (q_size,))
        w.k_norm = loader.take(prefix + "k_norm.weight", (k_size,))
    return Attention(w, rope, num_heads=Nq, num_kv_heads=Nkv, head_dim=D, qk_norm=qk_norm, eps=args.rms_norm_eps,
                     clip_qkv=clip_qkv)


def swiglu_weights(loader, prefix: str, hidden: int, inter: int, names=EXPERT_PROJECTIONS):
    """gate [I, H], up [I, H], down [H, I] from `{prefix}{name}.weight` (names in gate, up, down order)."""
    g, u, d = names
    return (loader.take_matrix(f"{prefix}{g}.weight", (inter, hidden)),
            loader.take_matrix(f"{prefix}{u}.weight", (inter, hidden)),
            loader.take_matrix(f"{prefix}{d}.weight", (hidden, inter)))


def dense_mlp(loader, prefix: str, hidden: int, inter: int) -> DenseMLP:
    return DenseMLP(*swiglu_weights(loader, prefix, hidden, inter))


def shared_expert(loader, prefix: str, hidden: int, inter: int, *, gate: str | None = None) -> SharedExpert:
    """A shared expert's SwiGLU from `{prefix}`, with a sigmoid gate [1, H] at `gate` if given."""
    return SharedExpert(*swiglu_weights(loader, prefix, hidden, inter),
                        gate_weight=loader.take(gate, (1, hidden)) if gate else None)


def gated_shared_moe(loader, prefix: str, layer: int, args, route, experts) -> MoEBlock:
    """The Qwen MoE block at `{prefix}` (its `mlp.`): routed experts, and a shared expert behind its
    sigmoid gate (`shared_expert.`, `shared_expert_gate.weight`)."""
    H = args.hidden_size
    shared = shared_expert(loader, prefix + "shared_expert.", H, args.shared_expert_intermediate_size,
                           gate=prefix + "shared_expert_gate.weight")
    return MoEBlock(layer, loader.take(prefix + "gate.weight", (args.num_experts, H)), route, experts,
                    top_k=args.num_experts_per_tok, shared=shared)


def norms(loader, prefix: str, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-attention and pre-FFN RMSNorm weights of a layer."""
    return (loader.take(prefix + "input_layernorm.weight", (hidden,)),
            loader.take(prefix + "post_attention_layernorm.weight", (hidden,)))


def embeddings(loader, args: BaseModelArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(embed, final norm, lm_head); lm_head is the embedding where the config ties them."""
    V, H = args.vocab_size, args.hidden_size
    tied = args.tie_word_embeddings and not loader.has("lm_head.weight")
    # kept packed where the kernels take it: a step dequantizes only the rows it gathers
    embed = loader.take_matrix(EMBEDDING, (V, H))
    lm_head = embed if tied else loader.take_matrix("lm_head.weight", (V, H))
    return embed, loader.take("model.norm.weight", (H,)), lm_head


def router_bits(bits: int | None) -> int | None:
    """Routers keep at least 8 bits (their top-k choice is sensitive to rounding)."""
    return None if bits is None else max(bits, 8)


def routers_keep_8_bits(*suffixes: str):
    """A family's quant_predicate: the matrices named `*suffix` (routers, gates) keep at least 8 bits."""
    def quant_predicate(name: str, bits: int | None) -> int | None:
        return router_bits(bits) if name.endswith(suffixes) else bits
    return quant_predicate


def sanitize(name: str) -> str | None:
    """The usual key map: checkpoint names are kept; rotary buffers (not weights) are left out."""
    return None if name.endswith("rotary_emb.inv_freq") else name


def softmax_router(args: BaseModelArgs, *, normalize: bool, float32_weights: bool = False):
    """logits -> (weights, ids): softmax over all experts, top-k, renormalized if asked; the
    weights in the activations' dtype, or float32 (Mixtral)."""
    def route(logits):
        return softmax_topk(logits, args.num_experts_per_tok, normalize=normalize,
                            out_dtype=torch.float32 if float32_weights else logits.dtype)
    # what MoEBlock.route tells a kernel that takes the router product and this routing at once
    route.softmax_topk = dict(top_k=args.num_experts_per_tok, normalize=normalize, float32_weights=float32_weights)
    return route


def decoder_layer(loader, prefix: str, args: BaseModelArgs, attn, ffn) -> DecoderLayer:
    """A pre-norm layer: input_layernorm -> attention -> post_attention_layernorm -> ffn."""
    return DecoderLayer(attn, ffn, *norms(loader, prefix, args.hidden_size), args.rms_norm_eps)


def routed_moe(loader, prefix: str, layer: int, args: BaseModelArgs, route, experts) -> MoEBlock:
    """The MoE block at `prefix` whose router is `{prefix}gate.weight` and has no shared expert."""
    router = loader.take(prefix + "gate.weight", (args.num_experts, args.hidden_size))
    return MoEBlock(layer, router, route, experts, top_k=args.num_experts_per_tok)


def build_layers(loader, args: BaseModelArgs, rope: Rope, attention, ffn) -> MoETransformer:
    """The model of pre-norm layers `attention(prefix, i)` -> `ffn(prefix, i)` at `model.layers.{i}.`."""
    layers = []
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        layers.append(decoder_layer(loader, p, args, attention(p, i), ffn(p, i)))
    return transformer(loader, args, rope, layers)


def transformer(loader, args: BaseModelArgs, rope: Rope, layers: list[DecoderLayer]) -> MoETransformer:
    """The model around `layers`: embeddings, final norm and head (tied where the config says)."""
    embed, final_norm, lm_head = embeddings(loader, args)
    return MoETransformer(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head, rope=rope,
                          eps=args.rms_norm_eps)


def text_model_config(config: dict, model_type: str, *, tie_default: bool | None = None) -> dict:
    """A multimodal checkpoint's language model: its `text_config`, with the outer config's
    `tie_word_embeddings` (which ties the language model's head; `tie_default` where it is absent)."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise FormatError(f"config.json of a {model_type} model has no text_config")
    merged = {**text, "model_type": model_type}
    tie = config.get("tie_word_embeddings", tie_default)
    if tie is not None:
        merged["tie_word_embeddings"] = tie
    return merged


def language_model_config(config: dict, model_type: str) -> dict:
    """The language model's settings where a checkpoint may carry them either way: nested in a
    `text_config` (as text_model_config reads it), or at the top level (a text-only save)."""
    if config.get("text_config") is not None:
        return text_model_config(config, model_type)
    return dict(config)
