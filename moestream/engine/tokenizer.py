"""The packed model's tokenizer and chat template, through transformers' fast tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

from moestream.errors import FormatError, NoTokenizerError


class TextTokenizer:
    def __init__(self, model_dir: str | Path, config: dict):
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        try:
            self._tok = AutoTokenizer.from_pretrained(str(model_dir))
        except Exception as exc:  # transformers raises many kinds; the user needs one line
            raise FormatError(f"{model_dir}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from None
        sources = [config.get("eos_token_id"), self._tok.eos_token_id]
        gen = model_dir / "generation_config.json"
        if gen.is_file():
            sources.append(json.loads(gen.read_text()).get("eos_token_id"))
        self.eos_token_ids = frozenset(i for value in sources for i in int_ids(value))

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    @property
    def backend(self):
        """The transformers tokenizer underneath (for grammar libraries that read its vocabulary)."""
        return self._tok

    @property
    def chat_template(self) -> str | None:
        template = getattr(self._tok, "chat_template", None)
        return template if isinstance(template, str) else None

    def token_id(self, text: str) -> int | None:
        """The id of a token spelled exactly `text` (e.g. a special token), or None."""
        tid = self._tok.convert_tokens_to_ids(text)
        return tid if isinstance(tid, int) and tid != self._tok.unk_token_id else None

    def chat_ids(self, messages: list[dict], *, add_generation_prompt: bool = True,
                 tools: list[dict] | None = None) -> list[int]:
        if not getattr(self._tok, "chat_template", None):
            raise FormatError("this model has no chat template; use a plain prompt")
        text = self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             tools=tools or None)
        return self.encode(text, add_special_tokens=False)


class NoTokenizer:
    """For packed models without tokenizer files (e.g. synthetic ones): token ids only."""

    def __init__(self, config: dict):
        self.eos_token_ids = frozenset(int_ids(config.get("eos_token_id")))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise NoTokenizerError("this model has no tokenizer files; give the prompt as token ids (--prompt-ids)")

    def chat_ids(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        return self.encode("")

    def decode(self, ids: list[int]) -> str:
        return ""


def int_ids(value) -> list[int]:
    """An `eos_token_id` as configs spell it (an int, a list of them, or nothing) as a list."""
    return [value] if isinstance(value, int) else [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def load_tokenizer(model_dir: str | Path, config: dict):
    """The model's TextTokenizer, or a NoTokenizer where the directory has no tokenizer files."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        return NoTokenizer(config)
    return TextTokenizer(model_dir, config)
