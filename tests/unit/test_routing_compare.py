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
