"""Per-token cost of the grammar mask (llguidance) on the demo model, in a real generation:
PYTHONPATH=$PWD python scripts/grammar_mask_cost.py (one JSON line per grammar)."""
import json, time, statistics, torch
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.types import SamplingParams, TokenHistory
from moestream.server.grammar import GrammarTokenizer, GrammarMask, json_schema_grammar, tool_call_grammar
e = Engine.load(None, options=EngineOptions(device="cpu"))
t0 = time.perf_counter(); gt = GrammarTokenizer(e.tokenizer, e.tokenizer.eos_token_ids, e.args.vocab_size); build = time.perf_counter() - t0
schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"], "additionalProperties": False}
for label, g in [("json_schema", json_schema_grammar(schema)), ("tool_call", tool_call_grammar([{"type": "function", "function": {"name": "f", "parameters": schema}}], "*", parallel=False))]:
    t0 = time.perf_counter(); m = gt.matcher(g); compile_s = time.perf_counter() - t0
    proc = GrammarMask(m); times = []
    def timed(gen):
        t = time.perf_counter(); out = proc(gen); times.append(time.perf_counter() - t); return out
    ids = e.tokenizer.encode("Describe a person as JSON:", add_special_tokens=False)
    t0 = time.perf_counter()
    out = [ev.token_id for ev in e.generate(ids, max_new_tokens=64, sampling=SamplingParams(temperature=0.8, seed=1, allowed_tokens=timed, history=TokenHistory()))]
    total = time.perf_counter() - t0
    print(json.dumps({"grammar": label, "vocab": e.args.vocab_size, "tokenizer_build_ms": round(build*1e3, 1), "compile_ms": round(compile_s*1e3, 2), "tokens": len(out), "mask_ms_median": round(statistics.median(times)*1e3, 3), "mask_ms_p90": round(sorted(times)[int(len(times)*0.9)]*1e3, 3), "decode_ms_per_token": round(total/len(out)*1e3, 2)}))
