"""What the coordinator knows of the target model: its tokenizer, chat template and limits.

From a GGUF file (what `specd models fetch` gives and the engine serves): the metadata through
specd/gguf_meta.py (end-of-generation ids as llama.cpp decides them, context length, logits width,
chat template, special tokens), and the tokenizer from ``<file>.tokenizer.json`` beside it when that
is there and not older than the file (`specd models fetch` writes it: loads in about 0.5 s), else
built from the metadata (2-4 s). From an HF model directory: its JSON files, as before.

Either way with the `tokenizers` library and transformers' jinja renderer (the one
`apply_chat_template` uses), never through transformers' model classes: those import torch, which
the coordinator does not run. tests/test_model_info.py checks every answer against transformers'
own tokenizer, loaded from the same directory or GGUF file.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from specd import gguf_meta

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    tokenizer: Tokenizer
    vocab_size: int  # rows of the target's output layer (may exceed the tokenizer's size)
    eos_token_ids: frozenset[int]
    max_context: int
    chat_template: str | None = None
    special_tokens: dict[str, Any] = field(default_factory=dict)  # bos_token, eos_token, ...: the template's names
    bos_token_id: int | None = None  # leads a session's first text turn (the model asks for one: Gemma, Llama)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt tokens of a conversation, ready for the assistant's turn."""
        rendered, _ = render_jinja_template([messages], chat_template=self.chat_template, add_generation_prompt=True,
                                            **self.special_tokens)
        ids = self.encode(rendered[0])
        starts = self.bos_token_id is not None and ids[:1] != [self.bos_token_id]  # once, as llama.cpp adds it
        return [self.bos_token_id, *ids] if starts else ids


def load_model_info(path: Path | str) -> ModelInfo:
    """A GGUF file's, or an HF model directory's."""
    path = Path(path)
    return _from_gguf(path) if path.is_file() else _from_directory(path)


def _from_gguf(path: Path) -> ModelInfo:
    meta = gguf_meta.read(path)
    try:
        tokenizer = _sidecar_tokenizer(path, meta) or Tokenizer.from_str(gguf_meta.tokenizer_json(meta))
        context = meta.context_length
        if context is None:
            raise gguf_meta.GGUFError(f"{path}: no {meta.architecture}.context_length in its metadata")
        return ModelInfo(tokenizer, meta.vocab_size, gguf_meta.eog_ids(meta), context, gguf_meta.chat_template(meta),
                         gguf_meta.special_tokens(meta), gguf_meta.session_start(meta))
    finally:
        meta.close()


def _sidecar_tokenizer(path: Path, meta: gguf_meta.Metadata) -> Tokenizer | None:
    """The tokenizer saved beside the file, if it is at least as new as the file and has its token
    count; else None (the caller builds it from the metadata)."""
    sidecar = gguf_meta.tokenizer_sidecar(path)
    try:
        if sidecar.stat().st_mtime_ns < path.stat().st_mtime_ns:
            log.warning("%s is older than %s: building the tokenizer from the GGUF's metadata", sidecar, path.name)
            return None
        tokenizer = Tokenizer.from_file(str(sidecar))
    except FileNotFoundError:
        return None
    except Exception as error:  # unreadable: rebuilding costs seconds, not correctness
        log.warning("%s: %s; building the tokenizer from the GGUF's metadata", sidecar, error)
        return None
    if tokenizer.get_vocab_size(with_added_tokens=True) != meta.count("tokenizer.ggml.tokens"):
        log.warning("%s does not hold %s's tokens: building the tokenizer from its metadata", sidecar, path.name)
        return None
    return tokenizer


def _from_directory(model_dir: Path) -> ModelInfo:
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
