"""Plain greedy decoding on CUDA, each step queued before the host reads its token, gives the tokens of
one step at a time (the path where the host reads log-probabilities), resident (one graph per step),
streamed by the host and by the device, and stops with the same tokens."""
import pytest

from moestream.engine.engine import UNREAD, Engine
from moestream.engine.options import EngineOptions
from moestream.format.reader import PackedModel

pytestmark = pytest.mark.gpu


def tokens(packed, logprobs, **options):
    engine = Engine.load(packed, options=EngineOptions(device="cuda", max_context=512, cpu_experts="off", **options))
    try:
        prompt = [t % engine.args.vocab_size for t in range(11, 90)]
        gen = engine.generate(prompt, max_new_tokens=64, stop_at_eos=False, logprobs=logprobs)
        out = [event.token_id for event in gen]
        again = [event.token_id for event in engine.generate(prompt[:40], max_new_tokens=16, stop_at_eos=False,
                                                             logprobs=logprobs)]
        assert UNREAD not in engine.cache.tokens
        return out, again, list(engine.cache.tokens)
    finally:
        engine.close()


@pytest.mark.parametrize("path", ["resident", "host-streamed", "device-streamed"])
def test_decode_ahead_gives_the_tokens_of_one_step_at_a_time(path, tiny_packed_model):
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16", num_hidden_layers=5)  # 32 experts
    sixteen = str(16 * max(e.record_size for e in PackedModel(packed).manifest.expert_layers))  # device path's least
    options = {"resident": dict(cache_size="all"),
               "host-streamed": dict(cache_size=sixteen),  # no host tier: the host drives
               "device-streamed": dict(cache_size=sixteen, host_cache_size="all")}[path]  # auto: the device
    assert tokens(packed, 0, **options) == tokens(packed, 1, **options)  # 0: ahead; 1: one step a token
