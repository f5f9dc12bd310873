"""`moestream synth`: random-weight packed models in a real model's shapes, written without a checkpoint.

The real shapes are gigabytes, so these tests register tiny shapes built from the real entries
(same keys, small sizes) and run the real code path on them."""
import json
import math

import pytest
import torch

import moestream.bench.synth as synth_module
import moestream.commands.synth as synth_command
from moestream.bench.synth import SHAPES, synth
from moestream.commands import generate as generate_cli
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.tokenizer import NoTokenizer
from moestream.errors import MoestreamError
from moestream.commands import verify as verify_command
from moestream.format import verify
from moestream.format.manifest import DENSE_NAME, EXPERT_PROJECTIONS, MANIFEST_NAME
from moestream.format.reader import PackedModel
from moestream.kernels.expert_layout import SlotLayout
from moestream.models.registry import weight_shapes
from tiny import model_args
from moestream.quant.affine import QuantSpec

SMALL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
             num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=0)
TINY = {
    "tiny-qwen3": dict(SHAPES["qwen3-30b-a3b"], **SMALL, head_dim=32, num_experts=8, moe_intermediate_size=64,
                       intermediate_size=256),
    "tiny-mixtral": dict(SHAPES["mixtral-8x7b"], **SMALL, head_dim=32, num_local_experts=8, intermediate_size=64),
    "tiny-olmoe": dict(SHAPES["olmoe-1b-7b"], **dict(SMALL, num_key_value_heads=4), num_experts=8, intermediate_size=64),
    "tiny-deepseek-v3": dict(SHAPES["deepseek-v3"], **dict(SMALL, num_key_value_heads=4), n_routed_experts=8,
                             moe_intermediate_size=64, intermediate_size=256, n_group=4, topk_group=2,
                             first_k_dense_replace=0, kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=16,
                             qk_nope_head_dim=32, v_head_dim=32),
    "tiny-glm-4.5-air": dict(SHAPES["glm-4.5-air"], **SMALL, head_dim=32, n_routed_experts=8, moe_intermediate_size=64,
                             intermediate_size=256, first_k_dense_replace=0),
    "tiny-minimax-m2": dict(SHAPES["minimax-m2"], **SMALL, head_dim=64, num_local_experts=8, intermediate_size=64,
                            rotary_dim=32),
    "tiny-gpt-oss": dict(SHAPES["gpt-oss-20b"], **SMALL, head_dim=32, num_local_experts=8, experts_per_token=2,
                         intermediate_size=64, sliding_window=16),
    # a linear-attention layer, then a full-attention one
    "tiny-qwen3-next": dict(SHAPES["qwen3-next-80b-a3b"], **SMALL, head_dim=32, num_experts=8, moe_intermediate_size=64,
                            shared_expert_intermediate_size=64, intermediate_size=256, full_attention_interval=2,
                            linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                            linear_num_value_heads=4),
}
PROMPT = [5, 17, 42, 99, 300]


@pytest.fixture(autouse=True)
def tiny_shapes(monkeypatch):
    for name, shape in TINY.items():
        monkeypatch.setitem(SHAPES, name, shape)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # an Engine with threads set changes the process-wide count


def sizes(cfg):
    experts = cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts")))
    inter = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
    return experts, inter, cfg["hidden_size"]


def test_tiny_shapes_keep_the_real_entries_keys():
    """The tiny shapes are the real entries with smaller numbers, so they take the same code paths."""
    for name, real in (("tiny-qwen3", "qwen3-30b-a3b"), ("tiny-mixtral", "mixtral-8x7b"), ("tiny-olmoe", "olmoe-1b-7b"),
                       ("tiny-deepseek-v3", "deepseek-v3"), ("tiny-minimax-m2", "minimax-m2"),
                       ("tiny-glm-4.5-air", "glm-4.5-air"), ("tiny-qwen3-next", "qwen3-next-80b-a3b"),
                       ("tiny-gpt-oss", "gpt-oss-20b")):
        assert set(TINY[name]) == set(SHAPES[real])
        assert TINY[name]["model_type"] == SHAPES[real]["model_type"]


@pytest.mark.parametrize("quant", ["q4", "none"])
@pytest.mark.parametrize("shape", sorted(TINY))
def test_synth_model_verifies_reads_back_and_generates(shape, quant, tmp_path, capsys):
    """A synth model passes `moestream verify`, reads back with its shape's config and one expert layer
    per layer, and the engine generates from token ids (it has no tokenizer)."""
    cfg = TINY[shape]
    experts, inter, hidden = sizes(cfg)
    out = synth(shape, tmp_path / "m", quant=quant)
    assert out == tmp_path / "m"

    assert verify_command.main([str(out), "--no-progress"]) == 0
    assert "OK, 3 files" in capsys.readouterr().out
    report = verify.verify(out)
    assert report.ok and report.layers == 2 and report.records == 2 * experts

    assert sorted(p.name for p in out.iterdir()) == [DENSE_NAME, "experts-000.bin", "experts-001.bin", MANIFEST_NAME]
    packed = PackedModel(out)
    assert packed.family == cfg["model_type"]
    assert packed.config == cfg
    assert packed.manifest.source == {"synthetic": shape, "seed": 0}
    bits = {"q4": 4, "none": None}[quant]
    assert packed.manifest.quantization["default_bits"] == bits
    assert [e.layer for e in packed.manifest.expert_layers] == [0, 1]
    for entry in packed.manifest.expert_layers:
        assert entry.num_experts == experts and len(entry.crc32) == experts
        assert (out / entry.file).stat().st_size == experts * entry.record_size
        for proj in EXPERT_PROJECTIONS:
            assert QuantSpec.from_json(entry.quant[proj]).bits == bits

    # stored form: the expert and attention matrices at the chosen bits, the router at 8 bits or float
    moe = "block_sparse_moe" if cfg["model_type"] in ("mixtral", "minimax_m2") else "mlp"
    router = f"{moe}.router" if cfg["model_type"] == "gpt_oss" else f"{moe}.gate"
    assert packed.tensor_spec("model.layers.1.self_attn.o_proj.weight").bits == bits
    assert packed.tensor_spec(f"model.layers.1.{router}.weight").bits == (8 if bits else None)
    assert packed.dense(f"model.layers.0.{router}.weight").shape == (experts, hidden)
    assert packed.dense("model.embed_tokens.weight").shape == (cfg["vocab_size"], hidden)
    w = packed.dequantized_expert(1, experts - 1)
    assert w["gate_proj"].shape == w["up_proj"].shape == (inter, hidden) and w["down_proj"].shape == (hidden, inter)
    # random weights spread about 0.02 around 0, quantized or not
    assert 0.01 < w["up_proj"].std().item() < 0.04 and abs(w["up_proj"].mean().item()) < 0.005

    engine = Engine.load(out, options=EngineOptions(device="cpu", threads=1))
    try:
        assert isinstance(engine.tokenizer, NoTokenizer)
        assert engine.args.num_hidden_layers == 2 and engine.plan.total_experts == 2 * experts
        logits, _ = engine.prefill(PROMPT)
        assert logits.shape[-1] == cfg["vocab_size"] and torch.isfinite(logits).all()
        engine.reset()
        gen = engine.generate(PROMPT, max_new_tokens=6, stop_at_eos=False)
        tokens = [e.token_id for e in gen]
        assert len(tokens) == 6 and all(0 <= t < cfg["vocab_size"] for t in tokens)
        assert gen.result.receipt["generated_tokens"] == 6 and gen.result.finish_reason == "length"
    finally:
        engine.close()


def test_same_seed_same_files_other_seed_other_weights(tmp_path):
    """Synth output is a function of shape, quant and seed."""
    def digests(path):
        return {name: info["sha256"] for name, info in PackedModel(path).manifest.files.items()}

    a = digests(synth("tiny-qwen3", tmp_path / "a", seed=3))
    assert a == digests(synth("tiny-qwen3", tmp_path / "b", seed=3))
    c = digests(synth("tiny-qwen3", tmp_path / "c", seed=4))
    assert all(a[name] != c[name] for name in a)


def test_generate_cli_takes_prompt_ids_on_a_synth_model(tmp_path, capsys):
    """`moestream generate --prompt-ids` runs a synth model; a text prompt is refused in one line."""
    out = synth("tiny-qwen3", tmp_path / "m", quant="q4")
    base = ["--model", str(out), "--device", "cpu", "--threads", "1"]
    assert generate_cli.main(base + ["--prompt-ids", "1,2,3", "--max-new", "4", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 1 <= len(obj["token_ids"]) <= 4 and obj["text"] == ""
    # without --json, stdout is the generated ids (there is no text to show), the stats on stderr
    assert generate_cli.main(base + ["--prompt-ids", "1,2,3", "--max-new", "4"]) == 0
    shown = capsys.readouterr()
    assert shown.out.strip() == ",".join(map(str, obj["token_ids"]))
    assert "expert hit rate" in shown.err
    assert generate_cli.main(base + ["--prompt", "hello"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moestream generate: error:") and "--prompt-ids" in err[0]


def test_layers_keeps_the_first_n_layers(tmp_path, capsys):
    """`--layers N` writes N layers, in the config and as expert files."""
    out = tmp_path / "m"
    assert synth_command.main([str(out), "--shape", "tiny-qwen3", "--layers", "1", "--quant", "q8"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    packed = PackedModel(out)
    assert packed.config["num_hidden_layers"] == 1
    assert [e.layer for e in packed.manifest.expert_layers] == [0]
    assert sorted(p.name for p in out.glob("experts-*.bin")) == ["experts-000.bin"]
    assert QuantSpec.from_json(packed.expert_layer(0).quant["down_proj"]).bits == 8
    assert not any(n.startswith("model.layers.1.") for n in packed.dense_names)
    assert verify.verify(out).ok
    engine = Engine.load(out, options=EngineOptions(device="cpu", threads=1))
    try:
        assert engine.args.num_hidden_layers == 1
        assert len(list(engine.generate(PROMPT, max_new_tokens=2, stop_at_eos=False))) == 2
    finally:
        engine.close()


def test_non_empty_out_is_refused_without_force(tmp_path, capsys):
    """A non-empty OUT is left alone and refused in one line (exit 1); --force writes over it."""
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert synth_command.main([str(out), "--shape", "tiny-qwen3"]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moestream synth: error:"), captured.err
    assert str(out) in err[0] and "--force" in err[0] and "Traceback" not in captured.err
    assert captured.out == ""
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    assert synth_command.main([str(out), "--shape", "tiny-qwen3", "--force"]) == 0
    assert verify.verify(out).ok
    manifest = (out / MANIFEST_NAME).read_bytes()
    assert synth_command.main([str(out), "--shape", "tiny-qwen3", "--seed", "1"]) == 1  # a finished model too
    assert (out / MANIFEST_NAME).read_bytes() == manifest

    empty = tmp_path / "empty"
    empty.mkdir()
    assert synth_command.main([str(empty), "--shape", "tiny-qwen3"]) == 0  # an empty OUT needs no --force


def test_unknown_shape_is_refused(tmp_path, capsys):
    """argparse refuses a shape it does not know (exit 2) and names the known ones; synth() raises."""
    with pytest.raises(SystemExit) as exc:
        synth_command.main([str(tmp_path / "m"), "--shape", "qwen9-1t"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'qwen9-1t'" in err and "qwen3-30b-a3b" in err
    with pytest.raises(MoestreamError, match="unknown shape"):
        synth("qwen9-1t", tmp_path / "m")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("layers,code", [("0", 2), ("-1", 2), ("3", 1)])
def test_layers_outside_the_shape_are_refused(layers, code, tmp_path, capsys):
    """Not a number of layers: a usage error (2); more than the shape has: 1."""
    out = tmp_path / "m"
    try:
        rc = synth_command.main(["--shape", "tiny-qwen3", "--layers", layers, str(out)])
    except SystemExit as exc:
        rc = exc.code
    assert rc == code
    err = capsys.readouterr().err
    assert "--layers" in err and len(err.strip().splitlines()) == 1 and not out.exists()


def test_force_leaves_no_files_of_the_model_it_replaces(tmp_path, capsys):
    out = tmp_path / "m"
    assert synth_command.main(["--shape", "tiny-qwen3", str(out)]) == 0
    assert synth_command.main(["--shape", "tiny-qwen3", "--layers", "1", "--force", str(out)]) == 0
    assert sorted(p.name for p in out.glob("experts-*.bin")) == ["experts-000.bin"]


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    out = tmp_path / "file"
    out.write_text("x")
    assert synth_command.main(["--shape", "tiny-qwen3", "--force", str(out)]) == 1
    assert "not a directory" in capsys.readouterr().err and out.read_text() == "x"


def test_synth_of_a_multimodal_shape_takes_its_language_models_layers(tmp_path, monkeypatch):
    """qwen3.5-35b-a3b keeps its settings under text_config: --layers cuts the language model."""
    text = dict(SHAPES["qwen3.5-35b-a3b"]["text_config"], hidden_size=128, num_attention_heads=4, head_dim=32,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                vocab_size=512, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, max_position_embeddings=256, eos_token_id=0)
    monkeypatch.setitem(SHAPES, "tiny-qwen3.5", dict(SHAPES["qwen3.5-35b-a3b"], text_config=text))
    out = synth("tiny-qwen3.5", tmp_path / "m", layers=4)
    assert verify.verify(out).ok
    packed = PackedModel(out)
    assert packed.family == "qwen3_5_moe" and packed.config["text_config"]["num_hidden_layers"] == 4
    assert [e.layer for e in packed.manifest.expert_layers] == [0, 1, 2, 3]
    assert packed.tensor_spec("model.layers.3.self_attn.o_proj.weight").bits == 4  # every 4th layer full attention
    assert packed.tensor_spec("model.layers.0.linear_attn.in_proj_b.weight").bits == 8
    engine = Engine.load(out, options=EngineOptions(device="cpu", threads=1))
    try:
        tokens = [e.token_id for e in engine.generate(PROMPT, max_new_tokens=4, stop_at_eos=False)]
        assert len(tokens) == 4
    finally:
        engine.close()
    with pytest.raises(MoestreamError, match="layers 1..40"):
        synth("qwen3.5-35b-a3b", tmp_path / "n", layers=41)


GEMMA = SHAPES["gemma-4-26b-a4b"]


def test_gemma4_shape_is_the_published_26b_a4b():
    """The real entry resolves through the gemma4 family to Gemma 4 26B-A4B as published: five sliding
    layers before each full one, full layers with 2 KV heads of 512 (keys as values), 8 of 128
    experts beside the dense MLP, about 25.2B parameters of which about 3.8B act per token."""
    args = model_args("gemma4", GEMMA)
    assert [i for i, t in enumerate(args.layer_types) if t == "full_attention"] == [5, 11, 17, 23, 29]
    assert {(s.heads, s.k_dim) for s in args.kv_layout()} == {(8, 256), (2, 512)}
    assert args.attention_k_eq_v and args.sliding_window == 1024 and args.final_logit_softcapping == 30.0
    assert args.tie_word_embeddings and args.moe_layers() == list(range(30))
    resident = sum(math.prod(dims) for dims in weight_shapes("gemma4", GEMMA).values())
    expert = sum(math.prod(dims) for dims in args.expert_shapes().values())
    assert round((resident + 30 * 128 * expert) / 1e9, 1) == 25.2
    assert round((resident + 30 * args.num_experts_per_tok * expert) / 1e9, 1) == 3.8


def test_gemma4_shape_with_layers_2_writes_a_sliding_and_a_full_layer(tmp_path, capsys, monkeypatch):
    """--layers 2 on the Gemma 4 entry (its keys, smaller numbers: the real one is a 1.3 GB file and a
    minute's load) keeps a sliding and a full layer, the full one without values; the engine decodes
    it with soft-capped logits."""
    text = dict(GEMMA["text_config"], hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                num_global_key_value_heads=1, global_head_dim=64, sliding_window=4, intermediate_size=256,
                num_experts=8, top_k_experts=2, moe_intermediate_size=64, vocab_size=512,
                vocab_size_per_layer_input=512, max_position_embeddings=256)
    monkeypatch.setitem(SHAPES, "tiny-gemma4", dict(GEMMA, text_config=text))
    assert set(text) == set(GEMMA["text_config"])
    out = tmp_path / "m"
    assert synth_command.main([str(out), "--shape", "tiny-gemma4", "--layers", "2"]) == 0
    assert verify.verify(out).ok
    packed = PackedModel(out)
    assert packed.family == "gemma4" and packed.config["text_config"]["num_hidden_layers"] == 2
    assert [e.layer for e in packed.manifest.expert_layers] == [0, 1]
    assert packed.manifest.expert_layers[0].quant["gate_proj"]["activation"] == "gelu_tanh"
    assert packed.dense("model.layers.0.self_attn.v_proj.weight").shape == (2 * 32, 128)
    assert "model.layers.1.self_attn.v_proj.weight" not in packed.dense_names  # full layer: keys as values
    assert packed.dense("model.layers.1.self_attn.k_proj.weight").shape == (64, 128)
    assert packed.tensor_spec("model.layers.1.router.proj.weight").bits == 8
    engine = Engine.load(out, options=EngineOptions(device="cpu", threads=1))
    try:
        assert [(s.heads, s.k_dim) for s in engine.args.kv_layout()] == [(2, 32), (1, 64)]
        logits, _ = engine.prefill(PROMPT)
        assert logits.shape[-1] == 512 and torch.isfinite(logits).all() and logits.abs().max() <= 30.0
        engine.reset()
        tokens = [e.token_id for e in engine.generate(PROMPT, max_new_tokens=3, stop_at_eos=False)]
        assert len(tokens) == 3 and all(0 <= t < 512 for t in tokens)
    finally:
        engine.close()
    with pytest.raises(MoestreamError, match="layers 1..30"):
        synth("gemma-4-26b-a4b", tmp_path / "n", layers=31)


def test_mxfp4_experts_are_records_convert_would_keep(tmp_path, capsys):
    """`--quant mxfp4`: the experts as MXFP4 records (e2m1 codes, one E8M0 scale per 32 inputs, the
    layout convert keeps of gpt-oss's checkpoints; the GPU kernels take it), the rest at 4 bits."""
    out = tmp_path / "m"
    assert synth_command.main([str(out), "--shape", "tiny-gpt-oss", "--quant", "mxfp4"]) == 0
    assert verify.verify(out).ok
    packed = PackedModel(out)
    assert packed.tensor_spec("model.layers.1.self_attn.o_proj.weight").bits == 4
    for entry in packed.manifest.expert_layers:
        specs = {p: QuantSpec.from_json(s) for p, s in entry.quant.items()}
        assert {(s.mode, s.bits, s.group_size, s.activation) for s in specs.values()} == {("mxfp4", 4, 32, "clamped_swiglu")}
        fields = {f.name: f for f in entry.fields}
        assert fields["gate_proj.weight"].dtype == fields["down_proj.scales"].dtype == "U8"
        assert SlotLayout.from_fields(entry.fields, specs).mx
    w = packed.dequantized_expert(1, 7)
    assert 0.01 < w["up_proj"].std().item() < 0.04 and abs(w["up_proj"].mean().item()) < 0.005
    codes = packed.expert_tensors(0, 0)["gate_proj.weight"]
    assert len(torch.unique(codes & 15)) == 16  # every code drawn, -0.0 included
    engine = Engine.load(out, options=EngineOptions(device="cpu", threads=1))
    try:
        assert len(list(engine.generate(PROMPT, max_new_tokens=3, stop_at_eos=False))) == 3
    finally:
        engine.close()
