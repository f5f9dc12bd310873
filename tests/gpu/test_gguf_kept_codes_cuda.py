"""A GGUF's kept codes on CUDA: a Q8_0 GGUF converted without --quant (8-bit group-32 records and
resident tensors holding the file's codes) decodes on the GPU to the tokens of the same file converted
with --quant none, and of the CPU, for the smallest cache and one holding every expert."""
import pytest

from moestream.convert.main import convert
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.format.reader import PackedModel
from moestream.quant.affine import QuantSpec

gguf = pytest.importorskip("gguf")
from gguf_files import Encoder, write_qwen3moe  # noqa: E402 (needs gguf)

pytestmark = pytest.mark.gpu
PROMPT = [5, 17, 42, 99, 3, 250]
STEPS = 16


@pytest.fixture(scope="module")
def models(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("qwen3_moe")
    folder = tmp_path_factory.mktemp("gguf-q8")
    path = write_qwen3moe(src, folder / "tiny-q8.gguf", encode=Encoder(gguf.GGMLQuantizationType.Q8_0))
    kept = convert(path, folder / "kept", progress=False, tokenizer=src)
    assert QuantSpec.from_json(PackedModel(kept).expert_layer(0).quant["gate_proj"]) == QuantSpec(8, 32)
    return kept, convert(path, folder / "none", quant="none", progress=False, tokenizer=src)


def greedy(model, *, prefetch=True, **options):
    engine = Engine.load(model, options=EngineOptions(**options), prefetch=prefetch)
    try:
        events = list(engine.generate(PROMPT, max_new_tokens=STEPS, logprobs=1, stop_at_eos=False))
        return [e.token_id for e in events], [e.logprob for e in events]
    finally:
        engine.close()


@pytest.mark.parametrize("cache_size", ["min", "all"])
def test_kept_q8_0_codes_decode_like_the_unquantized_conversion(models, cache_size):
    kept, none = models
    cuda = dict(device="cuda", dtype="float32", cache_size=cache_size, max_context=128)
    tokens, logprobs = greedy(kept, **cuda)
    ref_tokens, ref_logprobs = greedy(none, **cuda)
    cpu_tokens, _ = greedy(kept, device="cpu", threads=1, prefetch=False)
    assert tokens == ref_tokens == cpu_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-4
