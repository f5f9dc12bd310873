"""Tiny random checkpoints of every family, built with transformers, plus a small byte-level BPE
tokenizer with a chat template, so tests need no download."""
from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_TEXT = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Hello world! 1234567890",
    "import os\nimport sys\nclass Thing:\n    def __init__(self):\n        self.value = None\n",
    "naïve café — 東京 😀 ünïcödé text for multibyte characters",
]

FAMILY_CONFIGS = {
    "qwen3_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1, tie_word_embeddings=False),
    "qwen2_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                      num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[],
                      tie_word_embeddings=True),
    "mixtral": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2, tie_word_embeddings=False),
    "olmoe": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=False),
    # two dense layers' worth of shapes kept small: 8 experts in 4 groups of which the best 2 are eligible
    "glm4_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                     n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                     norm_topk_prob=True, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
                     tie_word_embeddings=False),
    # latent attention with a query low-rank; 8 experts in 4 groups, the best 2 groups eligible
    "deepseek_v3": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64,
                        q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                        routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True, tie_word_embeddings=False),
    # the same architecture, dense layers by mlp_layer_types, one expert group
    "glm4_moe_lite": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                          n_group=1, topk_group=1, n_shared_experts=2, mlp_layer_types=["dense", "sparse", "sparse"],
                          kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=64,
                          routed_scaling_factor=1.8, norm_topk_prob=True, tie_word_embeddings=False),
    # sliding (window 5: shorter than the test prompts) and full layers with their own head size,
    # KV heads and proportional rotary; keys as values on full layers; experts beside the dense MLP
    "gemma4_text": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                        num_global_key_value_heads=1, attention_k_eq_v=True, enable_moe_block=True, num_experts=8,
                        top_k_experts=2, hidden_size_per_layer_input=0, sliding_window=5,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                        final_logit_softcapping=30.0, tie_word_embeddings=True),
    # sliding (window 5: shorter than the test prompts) and full layers, sinks, YaRN, biased router
    # and experts; dims multiples of 64 so q4 quantizes every expert matrix
    "gpt_oss": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=5,
                    layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.5, tie_word_embeddings=False),
    # sigmoid routing with a correction bias; q/k norms over all heads (4 x 32 wider than hidden),
    # a quarter of each head rotary given as the released checkpoints give it (rotary_dim)
    "minimax_m2": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=2, rotary_dim=8,
                       tie_word_embeddings=False),
    # linear attention (Gated DeltaNet: 2 key heads shared by 4 value heads) every other layer, gated
    # full attention with a quarter of each head rotary, a shared expert behind its gate, a dense layer
    "qwen3_next": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                       shared_expert_intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                       mlp_only_layers=[2], full_attention_interval=2, linear_conv_kernel_dim=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                       linear_num_value_heads=4, tie_word_embeddings=False),
}
# Qwen3.5 MoE: a multimodal checkpoint (a small vision tower beside the language model), every layer
# MoE, the linear attention's projections apart, three linear layers before each full one
FAMILY_CONFIGS["qwen3_5_moe"] = dict(
    text_config={**{k: v for k, v in FAMILY_CONFIGS["qwen3_next"].items()
                    if k not in ("intermediate_size", "norm_topk_prob", "mlp_only_layers", "full_attention_interval")},
                 "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
    tie_word_embeddings=False,
    vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64))
# its language model saved alone (Qwen3_5MoeForCausalLM): the same settings at the top level
FAMILY_CONFIGS["qwen3_5_moe_text"] = dict(FAMILY_CONFIGS["qwen3_5_moe"]["text_config"], tie_word_embeddings=False)
# the multimodal checkpoint: the language model above beside a small vision tower
FAMILY_CONFIGS["gemma4"] = dict(
    text_config=FAMILY_CONFIGS["gemma4_text"], audio_config=None, tie_word_embeddings=True,
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=16))
# Kimi K2.5: the deepseek_v3 language model above beside a small vision tower and its projector
FAMILY_CONFIGS["kimi_k25"] = dict(
    text_config=FAMILY_CONFIGS["deepseek_v3"], tie_word_embeddings=False, projection_hidden_size=32,
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       pos_emb_height=4, pos_emb_width=4))
TEXT_FIELDS = ("vocab_size", "rope_theta", "max_position_embeddings", "eos_token_id", "bos_token_id", "pad_token_id")


def nest_text_fields(config: dict) -> dict:
    """A config with a text_config gets the language model's fields there."""
    if "text_config" not in config:
        return config
    text = {**config["text_config"], **{k: config[k] for k in TEXT_FIELDS if k in config}}
    return {**{k: v for k, v in config.items() if k not in TEXT_FIELDS}, "text_config": text}
# families whose vectors (norm weights, router and per-expert scales, layer scalars) start at 1 and
# multiply: drawn around 1 instead, so a misplaced or missing one changes the logits
SCALED_VECTORS = {"gemma4_text", "gemma4"}
# families whose 1-D biases and sink logits start at 0 or near it: drawn wider, so a missing one shows
DRAWN_VECTORS = {"gpt_oss"}
# hybrid linear-attention families: zero-centered norms (0 at init) and the DeltaNet's decay and
# convolution drawn so that a missing 1 + w, decay or convolution tap changes the logits
HYBRID = {"qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"}
# families saved as their multimodal model (the vision tower's weights in the checkpoint)
IMAGE_TEXT = {"qwen3_5_moe"}


def build_tokenizer(folder: Path, vocab_size: int = 320) -> int:
    """Train a byte-level BPE on a few lines; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TOKENIZER_TEXT * 4, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": CHAT_TEMPLATE, "model_max_length": 256}))
    return tok.get_vocab_size()


def build_checkpoint(folder: Path, family: str, *, seed: int = 0, dtype: str = "float32", **overrides) -> Path:
    """A random-weight checkpoint of `family` saved with save_pretrained, plus the tokenizer."""
    import torch
    from transformers import AutoConfig

    folder = Path(folder)
    vocab = build_tokenizer(folder)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    cfg = AutoConfig.for_model(family, **nest_text_fields(dict(
        vocab_size=vocab, rope_theta=10000.0, eos_token_id=eos, bos_token_id=None,
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        **{"max_position_embeddings": 256, **FAMILY_CONFIGS[family], **overrides})))
    torch.manual_seed(seed)
    model = model_class(cfg, image_text=family in IMAGE_TEXT).from_config(cfg)
    with torch.no_grad():  # random init is tiny; widen it so routing and logits are not near-ties
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
        if family in DRAWN_VECTORS:
            for name, p in model.named_parameters():
                if p.dim() == 1 and (name.endswith((".bias", ".sinks"))):
                    p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():  # a zero correction bias would leave the choice untested
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
            elif family in SCALED_VECTORS:
                p.uniform_(0.5, 1.5)
        if family in HYBRID:
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif name.endswith(("dt_bias", "conv1d.weight")):
                    p.normal_(0.0, 0.5)
                elif name.endswith("A_log"):
                    p.uniform_(-2.0, 0.5)
        if family in SCALED_VECTORS:
            for name, b in model.named_buffers():
                if name.endswith("layer_scalar"):  # a saved buffer (embed_scale is not saved: left alone)
                    b.uniform_(0.5, 1.5)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(folder)
    return folder


def model_class(cfg, *, image_text: bool = False):
    """The transformers auto class of a config: a causal LM, or an image-text model (Kimi K2.5 has no
    causal-LM class; `image_text` asks for it where both exist)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    causal = type(cfg) in MODEL_FOR_CAUSAL_LM_MAPPING and not image_text
    return AutoModelForCausalLM if causal else AutoModelForImageTextToText


def save_language_model(multimodal: Path, folder: Path, *, alone: bool) -> Path:
    """A multimodal checkpoint's language model saved as a text-only checkpoint with its weights:
    `alone`, as the text model's causal-LM class built from `text_config` saves it (its own names);
    else as AutoModelForCausalLM loads and saves the multimodal checkpoint (where transformers maps
    that to a text-only class, which keeps the multimodal names)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    folder = Path(folder)
    if alone:
        whole = AutoModelForImageTextToText.from_pretrained(multimodal, dtype=torch.float32)
        text = whole.config.text_config
        text.tie_word_embeddings = whole.config.tie_word_embeddings  # the outer setting ties the head
        model = AutoModelForCausalLM.from_config(text, dtype=torch.float32)
        model.model.load_state_dict(whole.model.language_model.state_dict())
        if not text.tie_word_embeddings:
            model.lm_head.load_state_dict(whole.lm_head.state_dict())
    else:
        model = AutoModelForCausalLM.from_pretrained(multimodal, dtype=torch.float32)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(multimodal) / name, folder / name)
    return folder


def load_all(folder):
    """Every tensor of a checkpoint folder's safetensors files, by name."""
    from safetensors import safe_open

    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def model_args(model_type: str, config: dict):
    """The family's ModelArgs for a config.json."""
    from moestream.models.registry import family_module

    return family_module(model_type).ModelArgs.from_dict(config)
