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


def route_as(engine, table: dict[tuple[int, int], frozenset]) -> None:
    """Make `engine` choose the experts `table` names at each (layer, position) it holds, their
    weights computed by the family's own router: its route_fn is partial(route, args, correction
    bias) (sigmoid routing), and the named experts' correction bias is raised above every score.
    A float32 reference routed as a bf16 run routed compares their numerics past a flipped tie."""
    import functools

    import torch

    from moestream.layers.moe import MoEBlock

    for block in (layer.ffn for layer in engine.model.layers if isinstance(layer.ffn, MoEBlock)):
        fn = block.route_fn
        assert isinstance(fn, functools.partial) and len(fn.args) == 2, "route_as takes a correction-bias router"
        route, args, bias = fn.func, *fn.args

        def forced(logits, layer=block.layer, route=route, args=args, bias=bias):
            weights, ids = [], []
            for t in range(logits.shape[0]):
                want = table.get((layer, engine._position + t), frozenset())
                lift = torch.zeros_like(bias)
                lift[list(want)] = 1e3
                w, i = route(args, bias + lift, logits[t:t + 1])
                assert not want or frozenset(i[0].tolist()) == want
                weights.append(w)
                ids.append(i)
            return torch.cat(weights), torch.cat(ids)

        block.route_fn = forced
