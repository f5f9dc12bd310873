"""Multi-token-prediction layers: convert keeps them byte for byte (or leaves them out, --no-mtp),
the MTP drafter proposes what the MTP module computed apart proposes (tests/mtp_checkpoints.py),
and speculative decoding with it gives plain decoding's tokens, greedy and sampled with a seed."""
import json
import shutil

import pytest
import torch
from models.test_generate_cli import run_here
from models.test_parity import load_reference
from mtp_checkpoints import ReferenceMTP, build_mtp_checkpoint, main_states, mtp_prefix, text_config
from safetensors.torch import load_file
from tiny import build_checkpoint

from moestream.convert.main import convert
from moestream.engine.engine import Engine
from moestream.engine.mtp_drafter import MTPDrafter
from moestream.engine.options import EngineOptions
from moestream.engine.draft_choice import make_options
from moestream.engine.speculative import SpeculativeOptions
from moestream.engine.types import SamplingParams
from moestream.errors import MoestreamError
from moestream.format.manifest import read_manifest
from moestream.format.reader import PackedModel

FAMILIES = ["deepseek_v3", "glm4_moe_lite", "glm4_moe", "qwen3_next", "qwen3_5_moe"]
PROMPT = "def fibonacci(n):\n    if n < 2:"
SAMPLED = SamplingParams(temperature=0.9, top_k=40, seed=1234)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """mtp_model(family, quant) -> (HF folder with MTP tensors, packed model) (cached)."""
    cache = {}

    def make(family, quant="none"):
        if family not in cache:
            folder = tmp_path_factory.mktemp(f"mtp-{family}")
            cache[family] = build_mtp_checkpoint(folder / "hf", family)
        key = (family, quant)
        if key not in cache:
            cache[key] = convert(cache[family], cache[family].parent / f"packed-{quant}", quant=quant, progress=False)
        return cache[family], cache[key]

    return make


def load(packed, **opts):
    return Engine.load(packed, options=EngineOptions(device="cpu", threads=1, **opts), prefetch=False)


def generate(engine, prompt, n, sampling, speculative=None):
    engine.reset()
    gen = engine.generate(prompt, max_new_tokens=n, sampling=sampling, stop_at_eos=False, speculative=speculative)
    tokens = [e.token_id for e in gen]
    return tokens, gen.result


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_keeps_the_mtp_tensors_byte_for_byte(family, mtp_model):
    hf, packed_dir = mtp_model(family)
    config = json.loads((hf / "config.json").read_text())
    source = load_file(str(hf / "mtp.safetensors"))
    packed = PackedModel(packed_dir)
    assert packed.manifest.mtp_layers == 1
    assert json.loads((packed_dir / "moestream.json").read_text())["mtp_layers"] == 1
    N = text_config(config)["num_hidden_layers"]
    expert_prefix = mtp_prefix(family, config) + "mlp.experts."
    resident = {k: v for k, v in source.items() if not k.startswith(expert_prefix)}
    assert resident and set(resident) <= set(packed.logical_dense_names())
    for name, t in resident.items():
        kept = packed.dense(name, t.dtype)
        assert kept.dtype == t.dtype and torch.equal(kept.view(torch.uint8), t.view(torch.uint8)), name
    entry = packed.manifest.expert_layer(N)  # MTP layer 0's experts: expert layer num_hidden_layers
    assert entry is not None and entry.num_experts == (text_config(config).get("num_experts") or config.get("n_routed_experts"))
    for e in range(entry.num_experts):
        record = packed.expert_tensors(N, e)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            t = source[f"{expert_prefix}{e}.{proj}.weight"]
            assert torch.equal(record[f"{proj}.weight"].view(torch.uint8).flatten(), t.view(torch.uint8).flatten())


@pytest.mark.parametrize("family", FAMILIES)
def test_no_mtp_and_checkpoints_without_mtp_pack_as_before(family, mtp_model, tmp_path):
    hf, _ = mtp_model(family)
    dropped = read_manifest(convert(hf, tmp_path / "no-mtp", quant="none", progress=False, mtp=False))
    plain_hf = tmp_path / "plain-hf"
    shutil.copytree(hf, plain_hf, ignore=shutil.ignore_patterns("mtp.safetensors"))
    plain = read_manifest(convert(plain_hf, tmp_path / "plain", quant="none", progress=False))
    raw = json.loads((tmp_path / "plain" / "moestream.json").read_text())
    assert "mtp_layers" not in raw and plain.mtp_layers == 0 and dropped.mtp_layers == 0
    assert dropped.files["dense.safetensors"] == plain.files["dense.safetensors"]
    assert [e.layer for e in dropped.expert_layers] == [e.layer for e in plain.expert_layers]
    assert all(e.layer < text_config(plain.config)["num_hidden_layers"] for e in plain.expert_layers)
    engine = load(tmp_path / "no-mtp")
    try:
        assert engine.model.mtp == []
        with pytest.raises(MoestreamError, match="no multi-token-prediction layers") as err:
            make_options("mtp", None, draft_tokens=2, main_engine=engine)
        assert "\n" not in str(err.value) and "--no-mtp" in str(err.value)
    finally:
        engine.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_drafts_equal_the_mtp_module_computed_apart(family, mtp_model, tmp_path):
    hf, packed = mtp_model(family)
    engine = load(packed, prefill_chunk_tokens=5)  # the prompt's pairs join the drafter's cache in pieces too
    drafter = MTPDrafter(engine)
    reference = ReferenceMTP(hf, family, tmp_path / "block")
    ref = load_reference(hf)
    try:
        prompt = engine.tokenizer.encode(PROMPT)
        engine.prefill(prompt)
        draft = drafter.propose(prompt, 4)
        tokens, rows = reference.drafts(main_states(ref, prompt), prompt, 4)
        assert draft == tokens
        for ours, theirs in zip(drafter.last_logits, rows, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
        # after speculative decoding (drafts kept and rejected, the cache rolled back each time) the
        # drafter's cache holds exactly the accepted context: its proposal is the reference's again
        options = SpeculativeOptions(drafter=drafter, draft_tokens=3)
        out, result = generate(engine, prompt, 40, SamplingParams(), options)
        assert result.receipt.to_json()["speculative"]["drafted"] > 0
        context = prompt + out
        # and a new prompt that leaves the last context part way keeps the pairs they share
        edited = context[:len(prompt) + 5] + [t for t in engine.tokenizer.encode(" return n") if t not in context[-1:]]
        for context in (context, edited):
            engine.prefill(context)
            draft = drafter.propose(context, 3)
            tokens, rows = reference.drafts(main_states(ref, context), context, 3)
            assert draft == tokens
            for ours, theirs in zip(drafter.last_logits, rows, strict=True):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    finally:
        drafter.close()
        engine.close()


@pytest.mark.parametrize("family,draft_tokens", [(f, 3) for f in FAMILIES] + [("deepseek_v3", None), ("qwen3_next", None)])
@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_speculation_with_mtp_gives_the_plain_tokens(family, draft_tokens, sampling, mtp_model):
    """A fixed length of 3, and the adaptive policy (lengths 0..4) on one family of each MTP naming."""
    _, packed = mtp_model(family, "q4")
    plain_engine = load(packed)
    prompt = plain_engine.tokenizer.encode(PROMPT)
    try:
        expected, _ = generate(plain_engine, prompt, 72, sampling)
    finally:
        plain_engine.close()
    engine = load(packed)
    options = make_options("mtp", None, draft_tokens=draft_tokens, max_draft_tokens=4, main_engine=engine)
    try:
        assert isinstance(options.drafter, MTPDrafter)
        drafted = 0
        for _ in range(2):  # a second generation reuses the prompt's cached prefix (and the drafter's)
            tokens, result = generate(engine, prompt, 72, sampling, options)
            assert tokens == expected
            spec = result.receipt.to_json()["speculative"]
            assert spec["drafter"] == "mtp"
            drafted += spec["drafted"]
        # (the adaptive policy may draft nothing in the second: a kept policy prices its first probe by
        # what the rejected ones cost)
        assert drafted > 0
    finally:
        options.drafter.close()
        engine.close()


def test_cli_refuses_mtp_for_a_model_without_it(tiny_packed_model, capfd):
    from models.test_generate_cli import one_line_error

    model = str(tiny_packed_model("qwen3_moe", "none"))
    one_line_error(run_here(capfd, "--model", model, "--prompt", "hi", "--speculative", "mtp", "--device", "cpu"),
                   "no multi-token-prediction layers")
    one_line_error(run_here(capfd, "--model", model, "--prompt", "hi", "--speculative", "mtp:x"), "--speculative")


def test_cli_generates_with_mtp(mtp_model, capfd):
    _, packed = mtp_model("deepseek_v3", "q4")
    base = ["--model", str(packed), "--prompt", PROMPT, "--max-new", "20", "--json", "--device", "cpu", "--threads", "1"]
    plain = run_here(capfd, *base)
    spec = run_here(capfd, *base, "--speculative", "mtp", "--draft-tokens", "2")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert json.loads(spec.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    assert json.loads(spec.stdout)["receipt"]["speculative"]["drafter"] == "mtp"


def test_an_incomplete_mtp_layer_is_refused_in_one_line(mtp_model, tmp_path):
    hf, _ = mtp_model("deepseek_v3")
    broken = tmp_path / "hf"
    shutil.copytree(hf, broken)
    tensors = load_file(str(broken / "mtp.safetensors"))
    N = json.loads((hf / "config.json").read_text())["num_hidden_layers"]
    del tensors[f"model.layers.{N}.eh_proj.weight"]
    from safetensors.torch import save_file

    save_file(tensors, str(broken / "mtp.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MoestreamError, match=f"model.layers.{N}.eh_proj.weight is missing") as err:
        convert(broken, tmp_path / "out", quant="none", progress=False)
    assert "\n" not in str(err.value)
    convert(broken, tmp_path / "out", quant="none", progress=False, mtp=False)  # without them it converts


def test_a_manifest_with_a_bad_mtp_count_is_refused(mtp_model, tmp_path):
    _, packed = mtp_model("deepseek_v3")
    bad = tmp_path / "bad"
    shutil.copytree(packed, bad)
    manifest = json.loads((bad / "moestream.json").read_text())
    manifest["mtp_layers"] = -1
    (bad / "moestream.json").write_text(json.dumps(manifest))
    with pytest.raises(MoestreamError, match="mtp_layers"):
        read_manifest(bad)


def test_a_plain_tiny_checkpoint_declaring_mtp_layers_has_none(tmp_path):
    hf = build_checkpoint(tmp_path / "hf", "deepseek_v3")  # transformers' config says num_nextn_predict_layers=1
    assert json.loads((hf / "config.json").read_text()).get("num_nextn_predict_layers") == 1
    manifest = read_manifest(convert(hf, tmp_path / "packed", quant="none", progress=False))
    assert manifest.mtp_layers == 0 and "mtp_layers" not in json.loads((tmp_path / "packed" / "moestream.json").read_text())


@pytest.mark.parametrize("keep", [True, False], ids=["mtp", "no-mtp"])
def test_pull_keeps_or_leaves_out_the_mtp_layers_as_convert_does(keep, mtp_model, tmp_path):
    from hub_repos import shard_checkpoint
    from hub_server import HubServer
    from unit.test_pull import same_model

    from moestream.convert.pull import pull

    hf, _ = mtp_model("qwen3_next")
    sharded = shard_checkpoint(hf, tmp_path / "repo", 3)
    converted = convert(sharded, tmp_path / "converted", quant="q4", progress=False, mtp=keep)
    with HubServer() as hub:
        hub.state.add_folder("tiny-org/tiny-mtp", sharded)
        pulled = pull("tiny-org/tiny-mtp", tmp_path / "pulled", endpoint=hub.url, progress=False, mtp=keep)
    same_model(pulled, converted)
    assert read_manifest(pulled).mtp_layers == (1 if keep else 0)
