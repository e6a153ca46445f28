"""What the coordinator knows of the target model: its tokenizer, chat template and limits.

Read from the model directory's JSON files with the `tokenizers` library and transformers' jinja
renderer (the one `apply_chat_template` uses), never through transformers' model classes: those
import torch, which the coordinator does not run. tests/test_model_info.py checks every answer
against transformers' own tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer
from transformers.utils.chat_template_utils import render_jinja_template


@dataclass(frozen=True)
class ModelInfo:
    tokenizer: Tokenizer
    vocab_size: int  # rows of the target's output layer (may exceed the tokenizer's size)
    eos_token_ids: frozenset[int]
    max_context: int
    chat_template: str | None = None
    special_tokens: dict[str, Any] = field(default_factory=dict)  # bos_token, eos_token, ...: the template's names

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt tokens of a conversation, ready for the assistant's turn."""
        rendered, _ = render_jinja_template([messages], chat_template=self.chat_template, add_generation_prompt=True,
                                            **self.special_tokens)
        return self.encode(rendered[0])


def load_model_info(model_dir: Path) -> ModelInfo:
    config = _json(model_dir / "config.json")
    tokenizer_config = _json(model_dir / "tokenizer_config.json")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special = {name: _content(value) for name, value in tokenizer_config.items()
               if name.endswith("_token") and _content(value) is not None}
    eos = _json(model_dir / "generation_config.json").get("eos_token_id", config.get("eos_token_id"))
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    if (eos_id := tokenizer.token_to_id(special.get("eos_token", ""))) is not None:
        eos_ids.add(eos_id)
    template = model_dir / "chat_template.jinja"
    chat_template = template.read_text() if template.is_file() else tokenizer_config.get("chat_template")
    return ModelInfo(tokenizer, config["vocab_size"], frozenset(eos_ids), config["max_position_embeddings"],
                     chat_template, special)


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's fields."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None
