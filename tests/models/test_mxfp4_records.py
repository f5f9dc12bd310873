"""MXFP4 expert records: gpt-oss's experts converted without re-quantizing. The records hold the
source's e2m1 codes and E8M0 scales byte for byte (gate and up rows split apart), dequantize to
transformers' values bit for bit, and the model gives the logits and greedy tokens of transformers
loading the MXFP4 checkpoint itself; the CPU's native kernels give the torch reference's tokens. The MXFP4 checkpoint is written by test_gpt_oss_mxfp4 from the
tiny one transformers builds."""
import dataclasses
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from moestream.commands.convert import main as convert_main
from moestream.convert.main import convert
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.errors import FormatError
from moestream.convert.export_hf import export_hf
from moestream.format.manifest import FIELD_ALIGN, MANIFEST_NAME
from moestream.format.reader import PackedModel
from moestream.format.verify import verify
from moestream.cpu_share import kernels as native
from moestream.cpu_share.kernels import refusal
from moestream.engine import plan as plan_module
from moestream.kernels.reference import projection
from moestream.layers import experts as experts_module
from moestream.layers.experts import RoutedExperts, TorchPlan
from moestream.quant import mxfp4
from moestream.quant.affine import QuantSpec
from tests.models.test_gpt_oss_mxfp4 import write_mxfp4_checkpoint
from tests.models.test_parity import INT8_TOTAL_VARIATION, prompt_for
from tests.unit.test_errors import CONVERT_INPUT_CASES
from tests.tiny import load_all

STEPS = 24
LAYERS, EXPERTS = (0, 1), 8


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tiny_checkpoint, tmp_path_factory):
    return write_mxfp4_checkpoint(tiny_checkpoint("gpt_oss"), tmp_path_factory.mktemp("mxfp4") / "hf")


@pytest.fixture(scope="module")
def kept(mxfp4_checkpoint, tmp_path_factory):
    """The MXFP4 checkpoint converted with convert's defaults: MXFP4 records."""
    return convert(mxfp4_checkpoint, tmp_path_factory.mktemp("kept") / "model", progress=False)


def source_projection_parts(raw: dict, layer: int, expert: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The source's blocks [out, G, 16] and scales [out, G] of each projection: gate_up_proj's rows
    alternate gate and up (transformers' gpt-oss)."""
    p = f"model.layers.{layer}.mlp.experts."
    gu_b, gu_s = raw[p + "gate_up_proj_blocks"][expert], raw[p + "gate_up_proj_scales"][expert]
    return {"gate_proj": (gu_b[0::2], gu_s[0::2]), "up_proj": (gu_b[1::2], gu_s[1::2]),
            "down_proj": (raw[p + "down_proj_blocks"][expert], raw[p + "down_proj_scales"][expert])}


def test_records_hold_the_sources_codes_and_scales_byte_for_byte(kept, mxfp4_checkpoint):
    packed, raw = PackedModel(kept), load_all(mxfp4_checkpoint)
    q = packed.manifest.quantization
    assert q["imported"] == "mxfp4" and "dequantized" not in q and q["requested"]["quant"] == "mxfp4"
    for layer in LAYERS:
        entry = packed.expert_layer(layer)
        specs = {p: QuantSpec.from_json(s) for p, s in entry.quant.items()}
        assert {(s.mode, s.bits, s.group_size, s.activation) for s in specs.values()} == {("mxfp4", 4, 32, "clamped_swiglu")}
        for expert in range(EXPERTS):
            record = packed.expert_tensors(layer, expert)
            assert not [n for n in record if n.endswith(".biases")]
            for proj, (blocks, scales) in source_projection_parts(raw, layer, expert).items():
                weight = record[f"{proj}.weight"]
                assert weight.dtype == torch.uint8 and record[f"{proj}.scales"].dtype == torch.uint8
                assert weight.numpy().tobytes() == blocks.numpy().tobytes(), (layer, expert, proj)
                assert record[f"{proj}.scales"].numpy().tobytes() == scales.numpy().tobytes(), (layer, expert, proj)
            p = f"model.layers.{layer}.mlp.experts."
            assert torch.equal(record["gate_proj.bias"], raw[p + "gate_up_proj_bias"][expert, 0::2])
            assert torch.equal(record["up_proj.bias"], raw[p + "gate_up_proj_bias"][expert, 1::2])
            assert torch.equal(record["down_proj.bias"], raw[p + "down_proj_bias"][expert])
    assert verify(kept).ok


def test_records_dequantize_to_transformers_values_bit_for_bit(kept, mxfp4_checkpoint):
    packed, raw = PackedModel(kept), load_all(mxfp4_checkpoint)
    for layer in LAYERS:
        p = f"model.layers.{layer}.mlp.experts."
        specs = {k: QuantSpec.from_json(s) for k, s in packed.expert_layer(layer).quant.items()}
        for dtype in (torch.bfloat16, torch.float32):
            gate_up = convert_moe_packed_tensors(raw[p + "gate_up_proj_blocks"], raw[p + "gate_up_proj_scales"], dtype=dtype)
            down = convert_moe_packed_tensors(raw[p + "down_proj_blocks"], raw[p + "down_proj_scales"], dtype=dtype)
            for expert in range(EXPERTS):
                want = {"gate_proj": gate_up[expert][:, 0::2].T, "up_proj": gate_up[expert][:, 1::2].T,
                        "down_proj": down[expert].T}
                got = packed.dequantized_expert(layer, expert, dtype)
                record = packed.expert_tensors(layer, expert)
                for proj, w in want.items():
                    assert got[proj].dtype == dtype and torch.equal(got[proj], w), (layer, expert, proj, dtype)
                    assert torch.equal(projection(record, proj, specs[proj], dtype), w)  # what the experts compute with
    assert (got["gate_proj"] != 0).float().mean() > 0.5


def transformers_reference(kept, mxfp4_checkpoint, out):
    """transformers' gpt-oss loaded from the MXFP4 checkpoint itself (its own dequantization of the
    blocks), with the resident weights set to the packed model's (stored at q4, dequantized). Its
    experts are checked equal to ours first."""
    ref = AutoModelForCausalLM.from_pretrained(mxfp4_checkpoint, quantization_config=Mxfp4Config(dequantize=True),
                                               attn_implementation="eager", experts_implementation="eager",
                                               dtype=torch.float32).eval()
    state, experts, ours = ref.state_dict(), 0, load_all(export_hf(kept, out))
    assert set(state) == set(ours)
    with torch.no_grad():
        for name, t in ours.items():
            if ".mlp.experts." in name:  # ours, dequantized from the records: transformers' values exactly
                assert torch.equal(state[name], t), name
                experts += 1
            else:
                state[name].copy_(t)
    assert experts == 4 * len(LAYERS)
    return ref


def test_logits_and_greedy_tokens_are_transformers_on_the_dequantized_weights(kept, mxfp4_checkpoint, tmp_path, float_activations):
    ref = transformers_reference(kept, mxfp4_checkpoint, tmp_path / "ref")
    engine = Engine.load(kept, options=EngineOptions(device="cpu"))
    try:
        prompt = prompt_for(engine)
        logits, _ = engine.prefill(prompt, all_logits=True)
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0].log_softmax(-1)
        assert (logits.log_softmax(-1) - expected).abs().max().item() < 1e-4
        events = list(engine.generate(prompt, max_new_tokens=STEPS, logprobs=1, stop_at_eos=False))
        seq, ref_tokens, ref_lp = list(prompt), [], []
        with torch.no_grad():
            for _ in range(STEPS):
                lp = ref(torch.tensor([seq])).logits[0, -1].log_softmax(-1)
                ref_tokens.append(int(lp.argmax()))
                ref_lp.append(float(lp.max()))
                seq.append(ref_tokens[-1])
        assert [e.token_id for e in events] == ref_tokens and len(ref_tokens) == STEPS
        assert max(abs(e.logprob - r) for e, r in zip(events, ref_lp)) < 1e-4
        assert len(set(ref_tokens)) > 1
    finally:
        engine.close()


def expert_outputs(model, layer: int, x, ids, weights, per_pair: bool) -> torch.Tensor:
    """The torch plan's routed-expert sum over a pool holding every record of `layer`."""
    packed = PackedModel(model)
    entry = packed.expert_layer(layer)
    pool = torch.stack([torch.frombuffer(bytearray(packed.read_record(layer, e)), dtype=torch.uint8)
                        for e in range(entry.num_experts)])
    quant = {p: QuantSpec.from_json(s) for p, s in entry.quant.items()}
    plan = TorchPlan(x, ids, weights, entry.fields, quant, per_pair=per_pair)
    chosen = torch.unique(ids).tolist()
    plan.run(pool, chosen, chosen)  # slot e holds expert e
    return plan.finish()


@pytest.mark.parametrize("per_pair", [False, True])
def test_mxfp4_records_compute_the_bits_of_float_records_of_the_same_values(kept, mxfp4_checkpoint, tmp_path, per_pair):
    """--quant none stores the dequantized values in float: the same weights, so the same bits."""
    plain = convert(mxfp4_checkpoint, tmp_path / "none", quant="none", progress=False)
    assert PackedModel(plain).manifest.quantization["dequantized"] == {"quant_method": "mxfp4"}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:4] for _ in range(6)])
    weights = torch.rand(6, 4, generator=gen).softmax(-1)
    for layer in LAYERS:
        got = expert_outputs(kept, layer, x, ids, weights, per_pair)
        assert torch.equal(got, expert_outputs(plain, layer, x, ids, weights, per_pair))
        assert got.abs().max() > 0


def test_packed_experts_take_4_25_bits_per_weight(kept, tmp_path, mxfp4_checkpoint):
    packed = PackedModel(kept)
    for entry in packed.manifest.expert_layers:
        fields = {f.name: f for f in entry.fields}
        weights = sum(fields[f"{p}.weight"].shape[0] * fields[f"{p}.weight"].shape[1] * 2
                      for p in ("gate_proj", "up_proj", "down_proj"))
        code_bytes = sum(f.nbytes for f in entry.fields if f.name.endswith((".weight", ".scales")))
        assert 8 * code_bytes / weights == mxfp4.BITS_PER_WEIGHT == 4.25
        assert weights == 3 * 64 * 64
        # nothing else but the biases and the alignment padding of fields and record
        payload = sum(-(-f.nbytes // FIELD_ALIGN) * FIELD_ALIGN for f in entry.fields)
        assert entry.record_size == -(-payload // 4096) * 4096
    q4 = PackedModel(convert(mxfp4_checkpoint, tmp_path / "q4", quant="q4", progress=False)).expert_layer(0)
    assert sum(f.nbytes for f in q4.fields if not f.name.endswith(".bias")) > code_bytes  # q4 at group 64 + f32 scales/biases


def test_explicit_quant_requantizes_and_the_cli_default_keeps(mxfp4_checkpoint, tmp_path, capsys):
    q4 = PackedModel(convert(mxfp4_checkpoint, tmp_path / "q4", quant="q4", progress=False))
    assert q4.manifest.quantization["dequantized"] == {"quant_method": "mxfp4"} and "imported" not in q4.manifest.quantization
    assert {QuantSpec.from_json(s).mode for s in q4.expert_layer(0).quant.values()} == {"affine"}
    assert convert_main([str(mxfp4_checkpoint), str(tmp_path / "cli"), "--no-progress", "--workers", "2"]) == 0
    cli = PackedModel(tmp_path / "cli")
    assert {QuantSpec.from_json(s).mode for s in cli.expert_layer(1).quant.values()} == {"mxfp4"}
    # resumable like any conversion: the finished one is recognised, an explicit --quant is another one
    assert convert_main([str(mxfp4_checkpoint), str(tmp_path / "cli"), "--no-progress", "--resume"]) == 0
    assert convert_main([str(mxfp4_checkpoint), str(tmp_path / "cli"), "--no-progress", "--resume", "--quant", "q4"]) == 1
    assert 'quant="mxfp4", not "q4"' in capsys.readouterr().err


# int8 activations against the float experts: measured 0.018 at worst over the positions of the greedy run
INT8_LOGPROB = 0.03


def greedy(model, *, native_experts: bool, forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """STEPS greedy tokens on the CPU device, the routed experts computed by the native kernels or
    (native_experts False) by the torch reference, as before they took MXFP4; and the log-probabilities
    at every position of the prompt followed by `forced` (None: those tokens)."""
    engine = Engine.load(model, options=EngineOptions(device="cpu"))
    try:
        assert all((layout is not None) == native_experts for layout in engine.experts.native.values())
        assert (engine.experts.unpacked is None) == native_experts  # no dequantized copies where native
        prompt = prompt_for(engine)
        tokens = [e.token_id for e in engine.generate(prompt, max_new_tokens=STEPS, stop_at_eos=False)]
        engine.reset()
        logits, _ = engine.prefill(prompt + (tokens if forced is None else forced), all_logits=True)
        return tokens, logits.log_softmax(-1)[len(prompt) - 1:]
    finally:
        engine.close()


@pytest.mark.parametrize("activations", ["float", "default"])
def test_cpu_native_kernels_give_the_torch_references_tokens(kept, monkeypatch, activations):
    """The CPU device computes MXFP4 records in the native kernels (gpt-oss's clamped SwiGLU and added
    biases). On the float rows: the greedy tokens the torch reference gave, its log-probabilities within
    float32 rounding. On int8 activations (where the CPU has VNNI), along the reference's greedy tokens:
    log-probabilities within INT8_LOGPROB, so the same token wherever the reference's leads by more than
    twice that (this run: every position but a near-tie of 0.002)."""
    entry = PackedModel(kept).expert_layer(0)
    assert refusal(entry.fields, {p: QuantSpec.from_json(s) for p, s in entry.quant.items()}) is None
    if activations == "float":
        monkeypatch.setattr(native, "activations", lambda: "float")
    with monkeypatch.context() as before:
        before.setattr(experts_module, "native_layout", lambda fields, quant: None)
        before.setattr(plan_module, "takes_every_layer", lambda packed: False)
        ref_tokens, ref = greedy(kept, native_experts=False)
    tokens, got = greedy(kept, native_experts=True, forced=ref_tokens)
    assert len(set(ref_tokens)) > 1
    picks = got.argmax(-1) == ref.argmax(-1)
    if activations == "float" or not native.vnni():
        assert tokens == ref_tokens and bool(picks.all())
        assert (got - ref).abs().max().item() < 1e-4
    else:
        assert 1e-4 < (got - ref).abs().max().item() < INT8_LOGPROB
        assert picks.float().mean().item() > 0.9


def test_cuda_layers_of_mxfp4_records_take_the_triton_kernels(kept, caplog):
    """RoutedExperts' kernel choice for a CUDA device (no device is touched): the Triton kernels read
    the converted MXFP4 records, with gpt-oss's clamped SwiGLU and biases or with SwiGLU; a record
    the kernels cannot read keeps the torch plan and says why in one line."""
    pytest.importorskip("triton")
    entry = PackedModel(kept).expert_layer(0)
    quant = {p: QuantSpec.from_json(s) for p, s in entry.quant.items()}
    silu = {p: dataclasses.replace(s, activation="silu") for p, s in quant.items()}
    provider = SimpleNamespace(quant=lambda layer: quant, record_fields=lambda layer: entry.fields)
    chooser = SimpleNamespace(parallel=None, device=torch.device("cuda"), provider=provider)
    with caplog.at_level("INFO", logger="moestream.layers.experts"):
        layout = RoutedExperts._layout(chooser, 0)
    assert layout.mx and layout.activation == "clamped_swiglu" and layout.has_bias and layout.hidden == 64
    assert "torch reference" not in caplog.text
    provider.quant = lambda layer: silu
    assert RoutedExperts._layout(chooser, 0).activation == "silu"
    bad = [dataclasses.replace(f, dtype="F16") if f.name == "down_proj.scales" else f for f in entry.fields]
    provider.record_fields = lambda layer: bad
    with caplog.at_level("INFO", logger="moestream.layers.experts"):
        assert RoutedExperts._layout(chooser, 0) is None
    assert "layer 0: torch reference for routed experts (down_proj.scales: dtype F16, expected U8)" in caplog.text


# -- bad input ---------------------------------------------------------------------------------------------------
def corrupt(folder, what: str) -> None:
    tensors = load_all(folder)
    name = "model.layers.1.mlp.experts.down_proj"
    if what == "nan scale":
        tensors[name + "_scales"][1, 2, 0] = 255
    elif what == "blocks not U8":
        tensors[name + "_blocks"] = tensors[name + "_blocks"].view(torch.int8)
    elif what == "blocks and scales disagree":
        tensors[name + "_blocks"] = tensors[name + "_blocks"][:, :, :1].contiguous()
    elif what == "blocks of another shape than config.json":
        tensors[name + "_blocks"] = tensors[name + "_blocks"][:, :32].contiguous()
        tensors[name + "_scales"] = tensors[name + "_scales"][:, :32].contiguous()
    save_file(tensors, str(folder / "model.safetensors"))


@pytest.mark.parametrize("what,code,message", CONVERT_INPUT_CASES, ids=[c[0] for c in CONVERT_INPUT_CASES])
def test_corrupt_mxfp4_checkpoint_is_one_line(what, code, message, mxfp4_checkpoint, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(mxfp4_checkpoint, src)
    corrupt(src, what)
    capsys.readouterr()
    assert convert_main([str(src), str(tmp_path / "out"), "--no-progress", "--workers", "1"]) == code
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == message.format(src=src)
    assert "Traceback" not in err


@pytest.mark.parametrize("where,key,value,problem", [
    ("field", "shape", [64, 31], "gate_proj: MXFP4 weight [64, 31] and scales [64, 2] are not [out, in/2] and [out, in/32]"),
    ("quant", "group_size", 64, "gate_proj: MXFP4 needs bits 4 and group size 32, not 4 and 64"),
    ("quant", "mode", "nvfp4", "gate_proj has quantization mode 'nvfp4' (this moestream reads affine, mxfp4)"),
])
def test_a_manifest_whose_mxfp4_layout_is_wrong_is_refused_in_one_line(kept, tmp_path, where, key, value, problem):
    model = tmp_path / "model"
    shutil.copytree(kept, model)
    manifest = json.loads((model / MANIFEST_NAME).read_text())
    layer = manifest["expert_layers"][0]
    if where == "field":
        field = next(f for f in layer["fields"] if f["name"] == "gate_proj.weight")
        field[key] = value
        field["nbytes"] = value[0] * value[1]
    else:
        layer["quant"]["gate_proj"][key] = value
    (model / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(FormatError) as info:
        PackedModel(model)
    assert str(info.value) == f"{model / MANIFEST_NAME}: experts-000.bin (layer 0): {problem}"


def test_every_code_and_scale_dequantizes_as_transformers_does():
    """All 16 codes under all 255 finite scales (the subnormal 2^-127 of scale 0 included), in a
    record's layout and as a stack, against transformers' dequantization and exact arithmetic."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # 32 inputs: every code twice
    byte_row = codes[0::2] | (codes[1::2] << 4)  # [16]
    scales = torch.arange(255, dtype=torch.uint8)  # one output row per scale
    blocks = byte_row.expand(255, 16)[None, :, None, :].contiguous()  # [1, 255, 1, 16]
    want = convert_moe_packed_tensors(blocks, scales[None, :, None], dtype=torch.float32)[0].T  # [255, 32]
    exact = torch.tensor([[mxfp4.E2M1[int(c)] * 2.0 ** (s - 127) for c in codes] for s in range(255)], dtype=torch.float64)
    got = mxfp4.dequantize_matrix(blocks[0, :, 0], scales[:, None])
    assert torch.equal(got, want) and torch.equal(got, exact.float())  # past float32: inf, as transformers
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # signed zeros too
    assert torch.equal(mxfp4.dequantize(blocks, scales[None, :, None], torch.float32)[0].T, want)
    assert torch.equal(mxfp4.dequantize_matrix(blocks[0, :, 0], scales[:, None], torch.bfloat16),
                       convert_moe_packed_tensors(blocks, scales[None, :, None], dtype=torch.bfloat16)[0].T)
