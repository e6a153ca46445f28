"""What the coordinator knows of the target model: its tokenizer and limits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase


@dataclass(frozen=True)
class ModelInfo:
    tokenizer: PreTrainedTokenizerBase
    vocab_size: int  # rows of the target's output layer (may exceed the tokenizer's size)
    eos_token_ids: frozenset[int]
    max_context: int

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def load_model_info(model_dir: Path) -> ModelInfo:
    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    return ModelInfo(tokenizer, config.vocab_size, frozenset(eos_ids), config.max_position_embeddings)
