"""Which multi-token-prediction (MTP) layers a conversion keeps (moestream.models.mtp).

A family's MTP layers are kept where the checkpoint has their tensors, unless the user leaves
them out (`--no-mtp`, a smaller pack); a checkpoint without them converts as before. Kept, they
are checked like the decoder's tensors (every one the family's build_mtp takes, of its shape)."""
from __future__ import annotations

import logging

from moestream.convert.layout import LayoutError
from moestream.models.registry import weight_shapes

log = logging.getLogger(__name__)


def select_mtp(source, layers: dict, dense_names: list[str], *, keep: bool) -> tuple[int, dict, list[str]]:
    """(MTP layers kept, the expert layers to write, the resident names to write)."""
    args = source.family_module.ModelArgs.from_dict(source.config)
    count = args.mtp_layer_count()
    resident = [n for n in dense_names if args.is_mtp_weight(n)]
    experts = [layer for layer in layers if layer >= args.num_hidden_layers]
    if keep and count and resident:
        have = set(dense_names)
        wanted = weight_shapes(source.family, source.config, present=have, mtp_layers=count)
        missing = [n for n in wanted if args.is_mtp_weight(n) and n not in have]
        if missing:
            raise LayoutError(f"{missing[0]} is missing: the checkpoint's multi-token-prediction layers are incomplete "
                              "(convert --no-mtp leaves them out)")
        log.info("keeping %d multi-token-prediction layer(s): %d resident tensors, %d expert layer(s)", count,
                 len(resident), len(experts))
        return count, layers, dense_names
    if resident or experts:
        why = "--no-mtp" if not keep else "the family builds none from this checkpoint"
        log.info("left out %d multi-token-prediction tensors and %d expert layer(s) (%s)", len(resident),
                 len(experts), why)
    dropped = set(resident)
    return 0, {k: v for k, v in layers.items() if k not in experts}, [n for n in dense_names if n not in dropped]
