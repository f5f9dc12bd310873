"""Where a family's multi-token-prediction (MTP) layers plug in.

A family whose checkpoints carry MTP layers gives:
  ModelArgs.mtp_layer_count()    how many config.json declares (`num_nextn_predict_layers`, ...)
  ModelArgs.is_mtp_weight(name)  whether a packed tensor belongs to one (convert keeps or drops them together)
  ModelArgs.expert_layer(prefix, layer)  where their routed experts are named apart from the decoder's
                                 (`mtp.layers.0.mlp`), the expert layer num_hidden_layers + j of MTP layer j
  build_mtp(args, loader, experts, model, count) -> [moestream.layers.mtp.MTPLayer]
The packed model keeps the MTP tensors under their checkpoint names (resident, like the decoder's)
and MTP layer j's routed experts as expert records of layer num_hidden_layers + j; its manifest's
`mtp_layers` says how many were kept (0: none, or `convert --no-mtp`). The engine builds them
beside the model (`Engine.mtp`) and `--speculative mtp` drafts with them
(moestream.engine.mtp_drafter).

DeepSeek-V3 and GLM-4.5 name theirs as decoder layers past the last one
(`model.layers.<num_hidden_layers + j>.`: enorm, hnorm, eh_proj, shared_head.norm/head, a full
decoder layer, and copies of the embedding): `nextn_layer` reads that naming for both."""
from __future__ import annotations

import re

from moestream.layers.mtp import MTPLayer
from moestream.layers.norm import rms_norm

LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def nextn_count(args) -> int:
    """config.json's num_nextn_predict_layers (0 where absent)."""
    return max(0, int(getattr(args, "num_nextn_predict_layers", 0) or 0))


def is_nextn_weight(args, name: str) -> bool:
    """`model.layers.<i>.*` with i past the decoder's layers (and within the declared MTP layers)."""
    m = LAYER.match(name)
    return m is not None and args.num_hidden_layers <= int(m[1]) < args.num_hidden_layers + nextn_count(args)


class NextNArgs:
    """The ModelArgs methods of a family whose MTP layers follow DeepSeek-V3's naming."""

    def mtp_layer_count(self) -> int:
        return nextn_count(self)

    def is_mtp_weight(self, name: str) -> bool:
        return is_nextn_weight(self, name)


def nextn_layer(loader, args, prefix: str, block, model, kv) -> MTPLayer:
    """An MTP layer in DeepSeek-V3's naming at `prefix` around its decoder `block`. Its embedding and
    head are its own copies where the checkpoint has them, else the main model's (shared)."""
    H, V = args.hidden_size, args.vocab_size
    embed_name, head_name = prefix + "embed_tokens.weight", prefix + "shared_head.head.weight"
    embed = loader.take(embed_name, (V, H)) if loader.has(embed_name) else model.embed_weight
    head = loader.take(head_name, (V, H)) if loader.has(head_name) else model.lm_head
    return MTPLayer(embed=embed, embed_norm=loader.take(prefix + "enorm.weight", (H,)),
                    hidden_norm=loader.take(prefix + "hnorm.weight", (H,)),
                    proj=loader.take(prefix + "eh_proj.weight", (H, 2 * H)), block=block,
                    final_norm=loader.take(prefix + "shared_head.norm.weight", (H,)), head=head, kv=kv, norm=rms_norm,
                    eps=args.rms_norm_eps)
