"""Lookahead guesses: scored against the layer's real choice, copies gated by measured accuracy."""
from moestream.experts.predict import Lookahead


class Provider:
    def __init__(self):
        self.asked = []

    def prefetch(self, layer, experts):
        self.asked.append((layer, list(experts)))
        return len(experts)


def test_guesses_are_scored_and_wrong_guessers_stop_copying():
    p = Provider()
    la = Lookahead(p, depth=2, min_accuracy=0.3, decay=0.5)
    assert la.guess(5, 1, [1, 2, 3, 4]) == 4  # unscored layers are tried
    la.guess(5, 2, [7, 8, 9, 10])
    la.score(5, [1, 2, 3, 9])
    stats = la.stats()
    assert stats["accuracy_per_layer"] == {"5@1": 0.75, "5@2": 0.25}
    assert stats["accuracy"] == {"depth1": 0.75, "depth2": 0.25}
    assert la.guess(5, 2, [7, 8, 9, 10]) == 0  # depth-2 guesses of layer 5 have been wrong: no copies
    assert la.guess(5, 1, [1, 2]) == 2
    assert p.asked == [(5, [1, 2, 3, 4]), (5, [7, 8, 9, 10]), (5, [1, 2])]
    for _ in range(6):  # depth 2 becomes right: its EMA climbs back over the bar
        la.score(5, [7, 8, 9, 10])
        la.guess(5, 2, [7, 8, 9, 10])
    assert p.asked[-1] == (5, [7, 8, 9, 10])


def test_a_layer_that_never_routes_again_keeps_no_guess_forever():
    la = Lookahead(Provider(), depth=1)
    la.guess(3, 1, [0])
    la.score(3, [1])
    assert la.pending == {}
