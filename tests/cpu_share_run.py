"""One greedy generation on the CPU with the CPU share of the misses on the device-driven path (the
protocol's tests run it on the CPU device): the tokens, their log-probabilities, the expert stats
and the receipt."""
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions

PROMPT = "def fibonacci(n):\n    if n < 2:"


def run_with_share(model, steps=12, fault_after=None, fault_delay_s=0.0, streaming="auto", **opts):
    """opts: EngineOptions fields (default: the smallest cache, a host tier of every record);
    streaming: the Engine's (the share runs on the device-driven path: "device" on the CPU).
    fault_after / fault_delay_s: the share's injected faults (its jobs from that number on fail;
    each first sleeps that long), set once streaming has started and before any job."""
    options = EngineOptions(device="cpu", prefill_chunk_tokens=5, **{"cache_size": "min", "host_cache_size": "all", **opts})
    engine = Engine.load(model, options=options, streaming=streaming)
    try:
        engine._make_resident()  # streaming starts here: the share with it
        if engine.experts.cpu_share is not None:
            engine.experts.cpu_share.set_faults(fault_after, fault_delay_s)
        gen = engine.generate(engine.tokenizer.encode(PROMPT), max_new_tokens=steps, logprobs=1, stop_at_eos=False)
        events = list(gen)
        return ([e.token_id for e in events], [e.logprob for e in events], engine.expert_stats(), gen.result.receipt,
                engine.streaming)
    finally:
        engine.close()
