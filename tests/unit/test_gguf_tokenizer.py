"""The tokenizer a GGUF carries in its metadata: tiny GGUFs written with the gguf package from a
Hugging Face tokenizer built here give the same token ids as that tokenizer (byte-level BPE with
GPT-2's, Qwen2's and o200k's split patterns, SentencePiece-style BPE with byte fallback), and a .gguf
converted without --tokenizer decodes and applies its chat template."""
import json

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from moestream.convert.gguf_tokenizer import O200K, QWEN2, tokenizer_from_metadata
from tiny import CHAT_TEMPLATE, TOKENIZER_TEXT

gguf = pytest.importorskip("gguf")

TEXTS = TOKENIZER_TEXT + [
    "Ωμέγα and ünseen characters: ṩ ℤ ∮ 🦀, tabs\tand  double  spaces\n\n\nnew lines",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "   leading spaces and trailing   ", "1234567 digits 3.14159 and 'quotes' don't we'll",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level(pattern: str | None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TOKENIZER_TEXT * 4, trainer)
    return tok


def sentencepiece_like() -> Tokenizer:
    """Llama's layout: <unk> <s> </s>, the 256 byte tokens, then learned pieces; ▁ for spaces."""
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=520, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(TOKENIZER_TEXT * 4, trainer)
    tok.pre_tokenizer = None  # transformers' Llama layout: a space before each text segment, no word split
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def write(path, tok: Tokenizer, kind: str, *, pre: str | None = None) -> dict:
    """A GGUF holding `tok` as llama.cpp's converter lays a tokenizer out; its fields by key."""
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_tokenizer_model(kind)
    w.add_token_list(tokens)
    special = set(SPECIALS) | {"<s>", "</s>"}
    if kind == "gpt2":
        types = [3 if t in special else 1 for t in tokens]
        w.add_tokenizer_pre(pre)
        merges = json.loads(tok.to_str())["model"]["merges"]
        w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
        w.add_eos_token_id(vocab["<|im_end|>"])
        w.add_chat_template(CHAT_TEMPLATE)
    else:
        types = [2 if t == "<unk>" else 3 if t in special else 6 if t.startswith("<0x") else 1 for t in tokens]
        w.add_token_scores([-float(i) for i in range(len(tokens))])  # SentencePiece BPE: a piece's score is -rank
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)
    w.add_token_types(types)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(str(path))
    return lambda key: reader.fields[key].contents() if key in reader.fields else None


@pytest.mark.parametrize("pre,pattern", [("default", None), ("qwen2", QWEN2), ("gpt-4o", O200K)])
def test_byte_level_bpe_gives_the_same_ids(tmp_path, pre, pattern):
    hf = byte_level(pattern)
    built = tokenizer_from_metadata(write(tmp_path / "t.gguf", hf, "gpt2", pre=pre))
    ours = Tokenizer.from_str(built.tokenizer_json)
    for text in TEXTS:
        assert ours.encode(text).ids == hf.encode(text).ids, text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text
    assert built.tokenizer_config["eos_token"] == "<|im_end|>"
    assert built.tokenizer_config["chat_template"] == CHAT_TEMPLATE


def test_sentencepiece_bpe_gives_the_same_ids(tmp_path):
    hf = sentencepiece_like()
    built = tokenizer_from_metadata(write(tmp_path / "t.gguf", hf, "llama"))
    ours = Tokenizer.from_str(built.tokenizer_json)
    for text in TEXTS:
        ids = hf.encode(text).ids
        assert ids[0] == 1 and 3 <= min(ids[1:], default=3)
        assert ours.encode(text).ids == ids, text
        assert ours.decode(ids, skip_special_tokens=True) == text  # byte tokens fused back into characters
    assert any(3 <= i < 259 for text in TEXTS for i in hf.encode(text).ids)  # byte fallback was exercised
    assert built.tokenizer_config["bos_token"] == "<s>" and built.tokenizer_config["add_bos_token"] is True


def test_unknown_pre_tokenizer_writes_none(tmp_path):
    fields = write(tmp_path / "t.gguf", byte_level(None), "gpt2", pre="some-future-model")
    assert tokenizer_from_metadata(fields) is None
