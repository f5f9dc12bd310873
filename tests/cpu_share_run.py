"""One greedy generation on the CPU with a CPU share of the misses (the host path's and the device
path's tests both run it): the tokens, their log-probabilities, the expert stats and the receipt."""
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions

PROMPT = "def fibonacci(n):\n    if n < 2:"


def run_with_share(model, steps=12, fault_after=None, fault_delay_s=0.0, **opts):
    """opts: EngineOptions fields (default: the smallest cache, a host tier of every record)."""
    options = EngineOptions(device="cpu", prefill_chunk_tokens=5, **{"cache_size": "min", "host_cache_size": "all", **opts})
    engine = Engine.load(model, options=options)
    if engine.experts.cpu is not None:
        engine.experts.cpu.fault_after = fault_after
        engine.experts.cpu.fault_delay_s = fault_delay_s
    try:
        gen = engine.generate(engine.tokenizer.encode(PROMPT), max_new_tokens=steps, logprobs=1, stop_at_eos=False)
        events = list(gen)
        return ([e.token_id for e in events], [e.logprob for e in events], engine.expert_stats(), gen.result.receipt,
                engine.streaming)
    finally:
        engine.close()

