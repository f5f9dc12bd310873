"""Comparing two runs' routing: a bf16 run is compared with its float32 reference only where both
chose the same experts (a flipped near-tie of a tiny random router moves every later step)."""
from __future__ import annotations


def routing(engine) -> dict[tuple[int, int], frozenset]:
    """(layer, position) -> the experts chosen, from the engine's routing trace (trace_routing set)."""
    trace = engine.trace.to_trace()
    return {(layer, pos): frozenset(row) for layer, pos, row
            in zip(trace.layer.tolist(), trace.position.tolist(), trace.experts.tolist())}


def flips(reference: dict, other: dict) -> list[tuple[int, int]]:
    """(position, layer) of every choice `other` made unlike `reference`, in order."""
    return sorted((pos, layer) for (layer, pos), chosen in reference.items() if other.get((layer, pos), chosen) != chosen)


def steps_routed_alike(reference: dict, other: dict, prompt_len: int, steps: int, *,
                       last_layer: int | None = None) -> list[int]:
    """The forced steps (0..steps-1, step j read from the logits at position prompt_len-1+j) whose
    logits come only from positions every MoE layer routed as in `reference`. A flip in
    `last_layer` (the model's last, where given) reaches only its own position's logits: no
    attention reads that layer's output at a later position."""
    flipped = flips(reference, other)
    first_flip = min((pos for pos, layer in flipped if layer != last_layer), default=prompt_len + steps)
    own = {pos for pos, layer in flipped if layer == last_layer}
    return [j for j in range(steps) if prompt_len - 1 + j < first_flip and prompt_len - 1 + j not in own]
