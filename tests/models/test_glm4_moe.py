"""glm4_moe specifics beyond parity: the multi-token-prediction layer real checkpoints carry, and
a bfloat16 model keeps the router's correction bias in float32."""
import shutil

import pytest
import torch
from safetensors.torch import save_file

from moestream.convert.main import convert
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.errors import MoestreamError
from moestream.format.reader import PackedModel


def test_an_incomplete_prediction_layer_is_refused_or_left_out(tiny_checkpoint, tiny_packed_model, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(tiny_checkpoint("glm4_moe"), folder)
    H, E = 64, 8
    extra = {"model.layers.3.eh_proj.weight": torch.randn(H, 2 * H), "model.layers.3.enorm.weight": torch.ones(H),
             "model.layers.3.mlp.gate.weight": torch.randn(E, H),
             **{f"model.layers.3.mlp.experts.{e}.{p}.weight": torch.randn(64, 64)
                for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")}}
    save_file(extra, str(folder / "mtp.safetensors"))
    with pytest.raises(MoestreamError, match=r"model.layers.3.\S+ is missing: .*incomplete \(convert --no-mtp"):
        convert(folder, tmp_path / "packed", quant="none")
    packed = convert(folder, tmp_path / "packed", quant="none", mtp=False)
    assert not [n for n in PackedModel(packed).dense_names if ".layers.3." in n]
    plain = Engine.load(tiny_packed_model("glm4_moe", "none"), options=EngineOptions(device="cpu"))
    with_mtp = Engine.load(packed, options=EngineOptions(device="cpu"))
    prompt = plain.tokenizer.encode("def fibonacci(n):")
    assert torch.equal(plain.prefill(prompt)[0], with_mtp.prefill(prompt)[0])


def test_bfloat16_keeps_the_router_and_correction_bias_in_float32(tiny_packed_model):
    engine = Engine.load(tiny_packed_model("glm4_moe", "none"), options=EngineOptions(device="cpu", dtype="bfloat16"))
    moe = engine.model.layers[1].ffn
    bias = moe.route_fn.args[1]
    assert bias.dtype == torch.float32 and moe.router.dtype == torch.float32
    assert bias.abs().sum() > 0


def test_bfloat16_follows_float32_until_a_near_tie_in_routing_flips(tiny_packed_model, tmp_path, float_activations):
    """bf16 against float32 on the CPU, teacher-forced on float32's tokens: within 0.05 in
    log-probability while both route alike. The router computes in float32 from the bf16 hidden
    state, as transformers does; bf16 rounding of that state still flips near-ties of the tiny
    random router (group sums 1e-3 apart), after which a step can move by 0.4."""
    from routing_compare import routing, steps_routed_alike

    packed = tiny_packed_model("glm4_moe", "q4", dtype="bfloat16")
    runs = {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine.load(packed, options=EngineOptions(device="cpu", dtype=dtype, trace_routing=str(tmp_path / dtype)))
        prompt = engine.tokenizer.encode("def fibonacci(n):\n    if n < 2:")
        if dtype == "float32":
            tokens = [e.token_id for e in engine.generate(prompt, max_new_tokens=32, stop_at_eos=False)]
        engine.reset()
        logits, _ = engine.prefill(prompt)
        logprobs = []
        for t in tokens:
            logprobs.append(float(torch.log_softmax(logits[-1].float(), -1)[t]))
            logits = engine.step([t])
        runs[dtype] = (logprobs, routing(engine))
        engine.close()
    (ref, ref_routing), (bf16, bf16_routing) = runs["float32"], runs["bfloat16"]
    alike = steps_routed_alike(ref_routing, bf16_routing, len(prompt), len(tokens))
    assert len(alike) >= 8
    assert max(abs(bf16[j] - ref[j]) for j in alike) < 0.05
