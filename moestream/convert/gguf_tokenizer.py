"""The tokenizer a GGUF file carries in its metadata (`tokenizer.ggml.*`), as a Hugging Face
tokenizer.json + tokenizer_config.json, so a .gguf converts without a tokenizer folder.

Two models are read, the ones llama.cpp writes for the MoE families we support:
- `gpt2`: byte-level BPE (tokens, merges); the pre-tokenizer's split pattern comes from
  `tokenizer.ggml.pre` (the name llama.cpp gives each known pattern: GPT-2's, Qwen2's, Llama 3's,
  o200k's for gpt-oss);
- `llama`: SentencePiece BPE (tokens, scores, byte tokens `<0xXX>`): merges are every pair of
  tokens whose concatenation is a token, ranked by that token's score (what SentencePiece merges
  first), spaces as ▁ with one put before the text and after each special token, as llama.cpp
  does, unknown characters as their UTF-8 bytes.
Control and user-defined tokens become added tokens; `add_bos_token` a post-processor; the chat
template is `tokenizer.chat_template`."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# llama.cpp's `tokenizer.ggml.pre` names and the split pattern each stands for
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
         r"\s+(?!\S)|\s+")
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
# o200k (gpt-oss): case-aware letter runs with contractions as a suffix, a trailing / kept with punctuation
O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
         r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
         r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_PATTERNS = {"default": None, "gpt-2": None, "gpt2": None, "qwen2": QWEN2, "llama-bpe": LLAMA3, "llama3": LLAMA3,
                "gpt-4o": O200K}


@dataclass
class GgufTokenizer:
    tokenizer_json: str
    tokenizer_config: dict


def tokenizer_from_metadata(field) -> GgufTokenizer | None:
    """`field(key)` gives a metadata value or None. None when the file has no tokenizer we read
    (logged: give --tokenizer)."""
    kind = field("tokenizer.ggml.model")
    tokens = field("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        return None
    types = field("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        pre = field("tokenizer.ggml.pre") or "default"
        if pre not in PRE_PATTERNS:
            log.warning("GGUF pre-tokenizer %r is not one moestream knows (known: %s): no tokenizer written; "
                        "give --tokenizer with the model's tokenizer folder", pre, ", ".join(PRE_PATTERNS))
            return None
        tok = _byte_level_bpe(tokens, field("tokenizer.ggml.merges") or [], PRE_PATTERNS[pre])
    elif kind == "llama":
        space_prefix = field("tokenizer.ggml.add_space_prefix")
        tok = _sentencepiece_bpe(tokens, field("tokenizer.ggml.scores") or [0.0] * len(tokens), types,
                                 field("tokenizer.ggml.unknown_token_id"), space_prefix is None or bool(space_prefix))
    else:
        log.warning("GGUF tokenizer model %r is not read (gpt2 and llama are): no tokenizer written; give --tokenizer", kind)
        return None
    _add_special_tokens(tok, tokens, types)

    def token(key):
        index = field(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    add_bos = bool(field("tokenizer.ggml.add_bos_token")) if field("tokenizer.ggml.add_bos_token") is not None \
        else kind == "llama"
    if add_bos and bos is not None:
        from tokenizers import processors
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tokens.index(bos))])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "unk_token": token("unknown"), "pad_token": token("padding"), "add_bos_token": add_bos,
              "clean_up_tokenization_spaces": False}
    template = field("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return GgufTokenizer(tok.to_str(), {k: v for k, v in config.items() if v is not None})


def _byte_level_bpe(tokens: list[str], merges: list[str], pattern: str | None):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, pairs))
    if pattern is None:  # GPT-2's own split pattern, which ByteLevel applies itself
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], unk: int | None, space_prefix: bool):
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = [i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED) and len(t) > 1]
    ranked = []
    for i in mergeable:
        piece = tokens[i]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, vocab[left], vocab[right], left, right))
    ranked.sort()
    unk_token = tokens[unk] if unk is not None and 0 <= int(unk) < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab, [(r[4], r[5]) for r in ranked], unk_token=unk_token, fuse_unk=True,
                               byte_fallback=True))
    # llama.cpp puts a space before the text and after each special token (add_space_prefix), then
    # spells spaces ▁; the text is not split into words
    steps = [normalizers.Prepend("▁")] if space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     *([decoders.Strip(" ", 1, 0)] if space_prefix else [])])
    return tok


def _add_special_tokens(tok, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken

    added = [AddedToken(t, special=types[i] == CONTROL, normalized=False)
             for i, t in enumerate(tokens) if types[i] in (CONTROL, USER_DEFINED)]
    if added:
        tok.add_tokens(added)


def write_files(folder, tokenizer: GgufTokenizer) -> list:
    """tokenizer.json and tokenizer_config.json in `folder`; their paths."""
    (folder / "tokenizer.json").write_text(tokenizer.tokenizer_json)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer.tokenizer_config, ensure_ascii=False, indent=1))
    return [folder / "tokenizer.json", folder / "tokenizer_config.json"]
