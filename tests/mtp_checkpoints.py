"""Tiny checkpoints with multi-token-prediction (MTP) layers, and a reference MTP computed apart.

transformers builds the main model (tiny.build_checkpoint) and ignores MTP weights, so the MTP
tensors are added here under the published names (DeepSeek-V3: `model.layers.<N>.*`; Qwen3-Next:
`mtp.*`) in a file of their own, with random values. The MTP layer's decoder block has the shape
of one of the model's own MoE layers (`BLOCK_LIKE`), so transformers can run it as that layer of
a copy of the model (`reference_block`): the block's reference; the rest of the MTP module (norms,
projection, head, chaining) is written out in `ReferenceMTP` in float32."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tiny import build_checkpoint, load_all

# a MoE layer (full attention for the Qwen hybrids) of tiny's configs, as the checkpoint names its layers
BLOCK_LIKE = {"deepseek_v3": 1, "glm4_moe_lite": 1, "glm4_moe": 1, "qwen3_next": 1, "qwen3_5_moe": 3}
LAYERS = {"qwen3_5_moe": "model.language_model.layers."}  # else "model.layers."
NEXTN = ("deepseek_v3", "glm4_moe_lite", "glm4_moe")  # MTP layers named as decoder layers past the last one


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def like_prefix(family: str) -> str:
    return f"{LAYERS.get(family, 'model.layers.')}{BLOCK_LIKE[family]}."


def text_model(model):
    """transformers' language model inside a causal LM (Qwen3.5's sits under model.language_model)."""
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


def mtp_prefix(family: str, config: dict) -> str:
    return f"model.layers.{text_config(config)['num_hidden_layers']}." if family in NEXTN else "mtp.layers.0."


def glue_names(family: str, config: dict) -> dict[str, tuple[int, ...]]:
    """The MTP module's own tensors besides its decoder block."""
    H, V = text_config(config)["hidden_size"], text_config(config).get("vocab_size", config.get("vocab_size"))
    if family in NEXTN:
        p = mtp_prefix(family, config)
        return {p + "enorm.weight": (H,), p + "hnorm.weight": (H,), p + "eh_proj.weight": (H, 2 * H),
                p + "shared_head.norm.weight": (H,), p + "shared_head.head.weight": (V, H),
                p + "embed_tokens.weight": (V, H)}
    return {"mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
            "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,)}


def mtp_tensors(family: str, folder: Path, *, seed: int = 7) -> dict[str, torch.Tensor]:
    """Random MTP tensors: the block shaped like layer BLOCK_LIKE (its tensors' names and shapes)."""
    config = json.loads((folder / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    like = like_prefix(family)
    shapes = {mtp_prefix(family, config) + k[len(like):]: tuple(t.shape) for k, t in load_all(folder).items()
              if k.startswith(like)}
    shapes.update(glue_names(family, config))
    out = {}
    for name, shape in sorted(shapes.items()):
        if len(shape) >= 2:
            t = torch.randn(shape, generator=gen) * 0.08
        elif name.endswith("e_score_correction_bias"):
            t = torch.randn(shape, generator=gen) * 0.05
        elif family not in NEXTN:  # zero-centered norms (scale 1 + w)
            t = torch.rand(shape, generator=gen) - 0.5
        else:
            t = torch.rand(shape, generator=gen) + 0.5
        out[name] = t.contiguous()
    return out


def build_mtp_checkpoint(folder: Path, family: str, **overrides) -> Path:
    """tiny.build_checkpoint, plus one MTP layer in `mtp.safetensors` and config.json saying so."""
    folder = build_checkpoint(folder, family, **overrides)
    save_file(mtp_tensors(family, folder), str(folder / "mtp.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    text_config(config)["num_nextn_predict_layers" if family in NEXTN else "mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def reference_block(folder: Path, family: str, work: Path):
    """transformers' model of the same config whose layer BLOCK_LIKE holds the MTP block's weights
    (main tensors otherwise): (that model, the layer)."""
    from models.test_parity import load_reference

    config = json.loads((folder / "config.json").read_text())
    work.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (folder / name).is_file():
            shutil.copyfile(folder / name, work / name)
    tensors = load_file(str(folder / "model.safetensors"))
    like, prefix = like_prefix(family), mtp_prefix(family, config)
    for k, v in load_file(str(folder / "mtp.safetensors")).items():
        if k.startswith(prefix) and like + k[len(prefix):] in tensors:  # the block's (not the glue's)
            tensors[like + k[len(prefix):]] = v
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(work / "model.safetensors"),
              metadata={"format": "pt"})
    model = load_reference(work)
    return model, text_model(model).layers[BLOCK_LIKE[family]]


def main_states(ref, ids: list[int]) -> torch.Tensor:
    """The reference model's final residual stream [T, H] (the final norm's input) for ids."""
    seen = {}
    hook = text_model(ref).norm.register_forward_pre_hook(lambda _m, args: seen.setdefault("x", args[0]))
    try:
        with torch.no_grad():
            ref(torch.tensor([ids]))
    finally:
        hook.remove()
    return seen["x"][0]


class ReferenceMTP:
    """The MTP module straight from the raw tensors (float32), its block run by transformers, with
    no cache: every call recomputes all positions under a causal mask."""

    def __init__(self, folder: Path, family: str, work: Path):
        self.family = family
        config = json.loads((folder / "config.json").read_text())
        self.eps = text_config(config).get("rms_norm_eps", 1e-6)
        t = load_all(folder)  # the model's tensors and the MTP's
        self.block_model, self.block = reference_block(folder, family, work)
        if family in NEXTN:
            p = mtp_prefix(family, config)
            self.embed, self.head = t[p + "embed_tokens.weight"], t[p + "shared_head.head.weight"]
            self.enorm, self.hnorm, self.proj = t[p + "enorm.weight"], t[p + "hnorm.weight"], t[p + "eh_proj.weight"]
            self.final = t[p + "shared_head.norm.weight"]
        else:
            embed = "model.language_model.embed_tokens.weight" if family in LAYERS else "model.embed_tokens.weight"
            self.embed, self.head = t[embed], t["lm_head.weight"]
            self.enorm, self.hnorm = 1 + t["mtp.pre_fc_norm_embedding.weight"], 1 + t["mtp.pre_fc_norm_hidden.weight"]
            self.proj, self.final = t["mtp.fc.weight"], 1 + t["mtp.norm.weight"]

    def norm(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def __call__(self, states: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """states [T, H] at positions 0..T-1, ids [T] (the token after each) -> (chained state [T, H], logits [T, V])."""
        T = len(ids)
        with torch.no_grad():
            e = self.embed[torch.tensor(ids)]
            x = torch.cat([self.norm(e, self.enorm), self.norm(states, self.hnorm)], -1) @ self.proj.T
            pos = torch.arange(T)[None]
            cos_sin = text_model(self.block_model).rotary_emb(x[None], pos)
            mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
            y = self.block(x[None], attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
            y = (y[0] if isinstance(y, tuple) else y)[0]
            normed = self.norm(y, self.final)
            return (y if self.family in NEXTN else normed), normed @ self.head.T

    def drafts(self, states: torch.Tensor, context: list[int], k: int) -> tuple[list[int], list[torch.Tensor]]:
        """k greedy drafts after `context` from the main states of positions 0..len-2, chained."""
        hs, ids = list(states[:len(context) - 1]), list(context[1:])
        tokens, rows = [], []
        for _ in range(k):
            out, logits = self(torch.stack(hs), ids)
            tokens.append(int(logits[-1].argmax()))
            rows.append(logits[-1])
            hs.append(out[-1])
            ids.append(tokens[-1])
        return tokens, rows

