"""`moestream convert model.gguf OUT`: a tiny Qwen3-MoE written as GGUF (F32, experts in Q8_0)
converts to the same model as its safetensors original, within Q8_0's error."""
import json

import numpy as np
import pytest
import torch

from moestream.convert.main import convert
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.errors import MoestreamError
from moestream.format.reader import PackedModel
from tiny import load_all

gguf = pytest.importorskip("gguf")  # pinned in requirements-ci.txt; absent only outside CI
from gguf_files import experts_only, write_qwen3moe  # noqa: E402 (needs gguf)


def write_gguf(hf_folder, path, *, expert_type, tokenizer=False):
    """The checkpoint as llama.cpp lays out arch qwen3moe: F32, the expert stacks in `expert_type`."""
    return write_qwen3moe(hf_folder, path, encode=experts_only(expert_type), tokenizer=tokenizer)


def logits(model_dir, tokens):
    engine = Engine.load(model_dir, options=EngineOptions(device="cpu", threads=1), prefetch=False)
    try:
        return engine.prefill(tokens, all_logits=True)[0]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("qwen3_moe")
    return src, convert(src, tmp_path_factory.mktemp("hf") / "m", quant="none", progress=False)


def test_f32_gguf_converts_to_the_same_weights(hf_model, tmp_path):
    src, reference = hf_model
    path = write_gguf(src, tmp_path / "tiny.gguf", expert_type=gguf.GGMLQuantizationType.F32)
    out = convert(path, tmp_path / "m", quant="none", progress=False, tokenizer=src)
    a, b = PackedModel(out), PackedModel(reference)
    assert a.manifest.config["num_experts"] == b.manifest.config["num_local_experts"] == 8
    assert a.manifest.config["mlp_only_layers"] == [1]
    for layer in (0, 2):
        for expert in range(8):
            for proj, t in a.dequantized_expert(layer, expert).items():
                assert torch.equal(t, b.dequantized_expert(layer, expert)[proj])
    prompt = [5, 17, 42, 99, 3, 250]
    assert torch.equal(logits(out, prompt), logits(reference, prompt))
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_q8_0_experts_match_within_quantization_error(hf_model, tmp_path):
    src, reference = hf_model
    path = write_gguf(src, tmp_path / "tiny-q8.gguf", expert_type=gguf.GGMLQuantizationType.Q8_0)
    out = convert(path, tmp_path / "m", quant="none", progress=False, tokenizer=src)
    a, b = PackedModel(out), PackedModel(reference)
    for expert in range(8):
        got, want = a.dequantized_expert(0, expert)["gate_proj"], b.dequantized_expert(0, expert)["gate_proj"]
        # exactly Q8_0's dequantized values (the gguf package's own round trip), within a step of the original
        q8 = gguf.GGMLQuantizationType.Q8_0
        assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(want.numpy(), q8), q8)))
        step = want.abs().reshape(-1, 32).amax(1) / 127
        assert ((got - want).abs().reshape(-1, 32) <= step[:, None] * 1.01).all()
        assert not torch.equal(got, want)  # the experts really went through Q8_0
    prompt = [5, 17, 42, 99, 3, 250]
    la, lb = logits(out, prompt), logits(reference, prompt)
    pa, pb = torch.log_softmax(la, -1), torch.log_softmax(lb, -1)
    assert (pa - pb).abs().max() < 0.05
    assert torch.equal(la.argmax(-1), lb.argmax(-1))


def test_unsupported_gguf_is_one_line(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "dense.gguf"), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(MoestreamError, match="GGUF architecture 'llama' is not a supported MoE"):
        convert(tmp_path / "dense.gguf", tmp_path / "m", progress=False)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(MoestreamError, match="not a readable GGUF file"):
        convert(tmp_path / "junk.gguf", tmp_path / "m2", progress=False)


def test_llama_arch_q_k_rows_are_put_back():
    """llama.cpp interleaves the two rotary halves of each head's rows for llama-arch q/k."""
    from moestream.convert.gguf_source import unpermute

    heads, head_dim, hidden = 4, 8, 16
    w = torch.randn(heads * head_dim, hidden)
    # GGUF row order within a head: 0, half, 1, half+1, ...
    order = torch.arange(head_dim).reshape(2, head_dim // 2).T.reshape(-1)
    stored = w.reshape(heads, head_dim, hidden)[:, order].reshape(w.shape)
    assert torch.equal(unpermute(stored, heads), w)


def test_mxfp4_experts_equal_the_gguf_dequantization(hf_model, tmp_path):
    """MXFP4 (how llama.cpp stores gpt-oss experts): the values are gguf's own dequantization, and
    the model equals a safetensors checkpoint holding those values."""
    src, reference = hf_model
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    path = write_gguf(src, tmp_path / "tiny-mxfp4.gguf", expert_type=mxfp4)
    out = convert(path, tmp_path / "m", quant="none", progress=False, tokenizer=src)
    tensors = load_all(src)
    for name, t in list(tensors.items()):
        if ".experts." in name:  # what the MXFP4 round trip makes of each expert, by gguf's own code
            tensors[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), mxfp4), mxfp4))
    same = tmp_path / "same"
    same.mkdir()
    for p in src.iterdir():
        if not p.name.endswith(".safetensors"):
            (same / p.name).write_bytes(p.read_bytes())
    from safetensors.torch import save_file
    save_file(tensors, str(same / "model.safetensors"))
    expected = PackedModel(convert(same, tmp_path / "s", quant="none", progress=False))
    got, original = PackedModel(out), PackedModel(reference)
    for layer in (0, 2):
        for expert in range(8):
            for proj, t in got.dequantized_expert(layer, expert).items():
                assert torch.equal(t, expected.dequantized_expert(layer, expert)[proj])
                assert not torch.equal(t, original.dequantized_expert(layer, expert)[proj])  # really MXFP4
    prompt = [5, 17, 42, 99, 3, 250]
    assert torch.equal(logits(out, prompt), logits(tmp_path / "s", prompt))


def test_tokenizer_and_chat_template_from_the_metadata(hf_model, tmp_path):
    """Without --tokenizer the GGUF's own tokenizer is written: the same ids, text and chat prompt as
    the Hugging Face tokenizer it was written from."""
    from moestream.engine.tokenizer import TextTokenizer

    src, reference = hf_model
    path = write_gguf(src, tmp_path / "tok.gguf", expert_type=gguf.GGMLQuantizationType.F32, tokenizer=True)
    out = convert(path, tmp_path / "m", quant="none", progress=False)
    assert (out / "tokenizer.json").is_file() and PackedModel(out).manifest.files["tokenizer.json"]
    ours, theirs = TextTokenizer(out, {}), TextTokenizer(reference, {})
    texts = ["def fibonacci(n):\n    return n", "naïve café — 東京 😀", "<|im_start|>user\nhi<|im_end|>\n"]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text)) == text
    messages = [{"role": "user", "content": "hello"}]
    assert ours.chat_ids(messages) == theirs.chat_ids(messages)
    assert ours.eos_token_ids >= {json.loads((src / "config.json").read_text())["eos_token_id"]}
    engine = Engine.load(out, options=EngineOptions(device="cpu", threads=1), prefetch=False)
    try:
        assert engine.tokenizer.encode("import os") == theirs.encode("import os")
    finally:
        engine.close()
