"""The routing comparison the bf16 tests use: which forced steps a flipped choice can reach."""
from routing_compare import flips, steps_routed_alike

PROMPT, STEPS = 14, 8  # step j reads the logits at position 13 + j


def reference():
    return {(layer, pos): frozenset({1, 2}) for layer in (0, 1) for pos in range(PROMPT + STEPS)}


def flipped(*where):
    return {**reference(), **{key: frozenset({1, 3}) for key in where}}


def test_a_flip_in_an_earlier_layer_reaches_every_later_step():
    assert steps_routed_alike(reference(), flipped((0, 16)), PROMPT, STEPS, last_layer=1) == [0, 1, 2]
    assert steps_routed_alike(reference(), flipped((0, 6)), PROMPT, STEPS, last_layer=1) == []


def test_a_flip_in_the_last_layer_reaches_only_its_own_position():
    assert steps_routed_alike(reference(), flipped((1, 6)), PROMPT, STEPS, last_layer=1) == list(range(STEPS))
    assert steps_routed_alike(reference(), flipped((1, 15)), PROMPT, STEPS, last_layer=1) == [0, 1, 3, 4, 5, 6, 7]
    assert steps_routed_alike(reference(), flipped((1, 6)), PROMPT, STEPS) == []  # no last layer given: every flip
    assert flips(reference(), flipped((1, 15), (0, 16))) == [(15, 1), (16, 0)]


def test_route_as_makes_an_engine_choose_the_named_experts(tiny_packed_model, tmp_path):
    import torch

    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions
    from routing_compare import route_as, routing

    packed = tiny_packed_model("deepseek_v3", "q4", dtype="bfloat16")

    def run(name, table=None):
        engine = Engine.load(packed, options=EngineOptions(device="cpu", trace_routing=str(tmp_path / name)))
        if table is not None:
            route_as(engine, table)
        logits, _ = engine.prefill(list(range(40, 52)))
        logprobs = [torch.log_softmax(logits[-1], -1)]
        for t in (5, 17, 300):
            logprobs.append(torch.log_softmax(engine.step([t])[-1], -1))
        out = routing(engine), torch.stack(logprobs)
        engine.close()
        return out

    own, lp = run("own")
    same, same_lp = run("same", own)
    assert same == own and torch.allclose(same_lp, lp, atol=1e-5)  # its own choices: its own numbers
    other = dict(own)
    chosen = own[(2, 13)]
    other[(2, 13)] = frozenset({min(chosen), next(e for e in range(8) if e not in chosen)})
    rerouted, rerouted_lp = run("other", other)
    assert rerouted == other and not torch.allclose(rerouted_lp[-2], lp[-2], atol=1e-3)
