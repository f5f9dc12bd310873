"""MXFP4 expert records on CUDA: every layer takes the Triton expert kernels (their MXFP4 variant)
by default; the records dequantize on the device to the CPU's bits, and greedy decoding gives the
CPU reference's tokens on either expert plan (Triton or the torch plan where asked), the same bits
for every cache size, with graphs on or off."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.format.reader import PackedModel
from moestream.kernels.reference import projection
from moestream.quant.affine import QuantSpec
from tests.models.test_gpt_oss_mxfp4 import write_mxfp4_checkpoint

pytestmark = pytest.mark.gpu
PROMPT = "def fibonacci(n):\n    if n < 2:"
STEPS = 24


@pytest.fixture(scope="module")
def kept(tiny_checkpoint, tmp_path_factory):
    from moestream.convert.main import convert

    src = write_mxfp4_checkpoint(tiny_checkpoint("gpt_oss"), tmp_path_factory.mktemp("mxfp4") / "hf")
    out = convert(src, tmp_path_factory.mktemp("kept") / "model", progress=False)
    assert PackedModel(out).manifest.quantization["imported"] == "mxfp4"
    return out


def greedy(engine):
    events = list(engine.generate(engine.tokenizer.encode(PROMPT), max_new_tokens=STEPS, logprobs=1, stop_at_eos=False))
    return [e.token_id for e in events], [e.logprob for e in events]


def test_records_dequantize_on_the_device_to_the_cpus_bits(kept):
    packed = PackedModel(kept)
    entry = packed.expert_layer(1)
    specs = {p: QuantSpec.from_json(s) for p, s in entry.quant.items()}
    for expert in (0, 5):
        record = packed.expert_tensors(1, expert)
        on_device = {k: v.cuda() for k, v in record.items()}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for dtype in (torch.float32, torch.bfloat16):
                assert torch.equal(projection(on_device, proj, specs[proj], dtype).cpu(),
                                   projection(record, proj, specs[proj], dtype))


def triton_layers(engine) -> list[bool]:
    return [engine.experts.uses_triton(i, engine.dtype) for i in engine.args.moe_layers()]


@pytest.fixture(scope="module")
def cpu_reference(kept):
    cpu = Engine.load(kept, options=EngineOptions(device="cpu", threads=1))
    try:
        return greedy(cpu)
    finally:
        cpu.close()


def test_triton_kernels_decode_like_the_cpu_reference_with_the_same_bits_for_two_cache_sizes(kept, cpu_reference):
    """The MXFP4 Triton kernels (every layer takes them) in float32: the CPU reference's (the torch
    plan's) greedy tokens, and the same tokens and logprobs, bit for bit, from the smallest cache
    (experts streamed through a few slots) and a cache holding every expert."""
    ref_tokens, ref_lp = cpu_reference
    runs = {}
    for size in ("min", "all"):
        engine = Engine.load(kept, options=EngineOptions(device="cuda", dtype="float32", cache_size=size, max_context=256))
        uses = triton_layers(engine)
        assert uses and all(uses)
        assert all(engine.experts.layouts[i].mx for i in engine.args.moe_layers())
        runs[size] = greedy(engine)
        engine.close()
        tokens, lp = runs[size]
        assert tokens == ref_tokens, size
        assert max(abs(a - b) for a, b in zip(lp, ref_lp)) < 1e-3
    assert runs["min"] == runs["all"]


def test_same_bits_for_every_cache_size_and_graphs_on_or_off(kept):
    runs = {}
    for size, graphs in (("min", True), ("50%", True), ("all", True), ("all", False)):
        engine = Engine.load(kept, options=EngineOptions(device="cuda", dtype="bfloat16", cache_size=size,
                                                         max_context=256), graphs=graphs)
        uses = triton_layers(engine)  # the MXFP4 Triton kernels
        assert uses and all(uses)
        runs[(size, graphs)] = greedy(engine)
        engine.close()
    first = next(iter(runs.values()))
    assert all(value == first for value in runs.values()), runs.keys()
