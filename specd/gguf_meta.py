"""A GGUF file's metadata, read without torch and without reading the weights.

The coordinator (which runs no torch) and the model services both read a model's facts here: its
architecture and limits, its end-of-generation tokens (`eog_ids`, as llama.cpp's vocabulary
decides them), a digest of its vocabulary (`vocab_digest`: draft and target must agree), and its
tokenizer as a `tokenizers` JSON (`tokenizer_json`) with its chat template and special tokens.

Why not `gguf.GGUFReader`: it builds a numpy view of every element of every metadata array, and
a Qwen2.5 file has 151,936 tokens and 151,387 merges: 6.7 s on the 1.1 GB target (2 cores).
This reader walks the same layout (the `gguf` package's constants) with `struct` over an `mmap`,
decodes an array only when it is asked for, and reads the metadata of that file in 0.04 s (its
tokens, when asked for, in 0.07 s more; the vocabulary digest hashes their bytes as stored: 6 ms).
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

_SCALAR = {  # fixed-size value types: struct format
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_VERSIONS = (2, 3)


class GGUFError(ValueError):
    """Not a GGUF file this reader understands, or a field of the wrong type."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the fastest-moving (a matrix's row length)
    ggml_type: int
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy/torch order: (rows, row length) for a matrix."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class _Array:
    """A metadata array not decoded yet: where it is and what it holds."""

    element_type: int
    count: int
    start: int  # first element
    end: int  # just past the last


class Metadata:
    """One GGUF file's key/values and tensor table. Arrays are decoded on first use and kept."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._raw: dict[str, Any] = {}
        self._decoded: dict[str, list] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    # --- reading ---------------------------------------------------------------

    def _parse(self) -> None:
        buf = self._buf
        if len(buf) < 24 or struct.unpack_from("<I", buf, 0)[0] != GGUF_MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (no GGUF magic)")
        self.version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
        if self.version not in _VERSIONS:
            raise GGUFError(f"{self.path}: GGUF version {self.version} (this reader handles 2 and 3)")
        pos = 24
        for _ in range(kv_count):
            key, pos = self._string(pos)
            (value_type,) = struct.unpack_from("<I", buf, pos)
            self._raw[key], pos = self._value(pos + 4, value_type)
        entries = []
        for _ in range(tensor_count):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            entries.append((name, tuple(dims), ggml_type, offset))
        alignment = self.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        self.data_offset = -(-pos // alignment) * alignment
        for name, dims, ggml_type, offset in entries:
            self.tensors[name] = TensorInfo(name, dims, ggml_type, self.data_offset + offset, _nbytes(ggml_type, dims))

    def _string(self, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._buf, pos)
        pos += 8
        return self._buf[pos : pos + length].decode("utf-8"), pos + length

    def _value(self, pos: int, value_type: int) -> tuple[Any, int]:
        if value_type in _SCALAR:
            fmt = _SCALAR[value_type]
            return struct.unpack_from(fmt, self._buf, pos)[0], pos + struct.calcsize(fmt)
        if value_type == GGUFValueType.STRING:
            return self._string(pos)
        if value_type != GGUFValueType.ARRAY:
            raise GGUFError(f"{self.path}: metadata value of unknown type {value_type}")
        element_type, count = struct.unpack_from("<IQ", self._buf, pos)
        start = pos = pos + 12
        if element_type in _SCALAR:
            pos += count * struct.calcsize(_SCALAR[element_type])
        elif element_type == GGUFValueType.STRING:
            unpack, buf = struct.Struct("<Q").unpack_from, self._buf
            for _ in range(count):  # variable-length: walk it (0.05 s for 300k strings)
                pos += 8 + unpack(buf, pos)[0]
        else:  # arrays of arrays: decode now (none in the files we serve)
            values = []
            for _ in range(count):
                value, pos = self._value(pos, element_type)
                values.append(value)
            return values, pos
        return _Array(element_type, count, start, pos), pos

    def _decode(self, key: str, array: _Array) -> list:
        if key not in self._decoded:
            if array.element_type == GGUFValueType.STRING:
                values, pos, buf = [], array.start, self._buf
                unpack = struct.Struct("<Q").unpack_from
                for _ in range(array.count):
                    (length,) = unpack(buf, pos)
                    values.append(buf[pos + 8 : pos + 8 + length].decode("utf-8"))
                    pos += 8 + length
            else:
                fmt = _SCALAR[array.element_type]
                values = list(struct.unpack_from(f"<{array.count}{fmt[1]}", self._buf, array.start))
            self._decoded[key] = values
        return self._decoded[key]

    # --- asking ----------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self._raw

    def keys(self) -> Iterable[str]:
        return self._raw.keys()

    def get(self, key: str, default: Any = None) -> Any:
        """A field's value: a number, bool or str, or a list for an array; `default` if absent."""
        value = self._raw.get(key, default)
        return self._decode(key, value) if isinstance(value, _Array) else value

    def count(self, key: str) -> int | None:
        """An array's length without decoding it (None: no such array)."""
        value = self._raw.get(key)
        return value.count if isinstance(value, _Array) else len(value) if isinstance(value, list) else None

    def raw_bytes(self, key: str) -> bytes | None:
        """An array's elements as stored (for digests), or None."""
        value = self._raw.get(key)
        return bytes(self._buf[value.start : value.end]) if isinstance(value, _Array) else None

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{suffix}", default)

    @property
    def architecture(self) -> str:
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path} has no general.architecture")
        return arch

    @property
    def name(self) -> str:
        """general.name, or the file's name."""
        return self.get("general.name") or self.path.name

    @property
    def context_length(self) -> int | None:
        return self.arch_get("context_length")

    @property
    def vocab_size(self) -> int:
        """Rows of the token embedding (the logits' width), else the tokenizer's token count."""
        embedding = self.tensors.get("token_embd.weight")
        if embedding is not None and len(embedding.dims) == 2:
            return embedding.dims[1]
        count = self.count("tokenizer.ggml.tokens")
        if count is None:
            raise GGUFError(f"{self.path}: neither token_embd.weight nor tokenizer.ggml.tokens")
        return count

    @property
    def tokens(self) -> list[str]:
        tokens = self.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise GGUFError(f"{self.path} carries no tokenizer (tokenizer.ggml.tokens)")
        return tokens

    def close(self) -> None:
        """Unmap the file (arrays not decoded yet can no longer be read)."""
        self._buf.close()

    def __enter__(self) -> "Metadata":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Metadata({str(self.path)!r}, architecture={self.get('general.architecture')!r})"


def read(path: Path | str) -> Metadata:
    return Metadata(path)


# The tokenizer JSON kept beside a GGUF file (`specd models fetch` writes it; the coordinator reads it
# instead of building the tokenizer from the metadata): model.gguf -> model.gguf.tokenizer.json.
TOKENIZER_SIDECAR_SUFFIX = ".tokenizer.json"


# Bumped whenever tokenizer_json's output changes: `specd models fetch` writes the sidecar again.
TOKENIZER_JSON_VERSION = 1


def tokenizer_sidecar(path: Path | str) -> Path:
    path = Path(path)
    return path.with_name(path.name + TOKENIZER_SIDECAR_SUFFIX)


def is_gguf(path: Path | str) -> bool:
    """A file whose first bytes are the GGUF magic (a directory is not)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return path.is_file() and f.read(4) == struct.pack("<I", GGUF_MAGIC)
    except OSError:
        return False


def _nbytes(ggml_type: int, dims: Sequence[int]) -> int:
    elements = 1
    for d in dims:
        elements *= d
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return 0  # a type this gguf version does not know: the engine refuses it, not the reader
    return elements // block * size


# --- end of generation ---------------------------------------------------------

# llama.cpp src/llama-vocab.cpp (llama_vocab::impl::load, 2026): the token texts that end generation.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})
# The fill-in-the-middle tokens llama.cpp also ends on (pad, repo, file separator), found by text
# when the file names none.
_FIM_EOG_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# llama.cpp's default eos when the file names none, by tokenizer.ggml.model.
_DEFAULT_EOS = {"llama": 2, "gpt2": 11, "t5": 1}


def eog_ids(meta: Metadata) -> frozenset[int]:
    """The token ids that end generation, as llama.cpp's vocabulary decides them: the file's eos,
    eot and eom ids, its fill-in-the-middle pad/repo/separator tokens, and every token whose text
    is one of `EOG_TEXTS`; less `<|end|>` in a harmony vocabulary (which has `<|return|>` and
    `<|call|>`, or solar-open's `<|calls|>` and `<|flush|>`) and `</s>` in one with `<|tool_response>`.

    Where llama.cpp picks one of several candidate texts in hash-map order (a FIM token), this
    takes the lowest id. Matching is by text only, as llama.cpp's: Qwen2.5's vocabulary ends on
    <|endoftext|>, <|im_end|>, <|fim_pad|>, <|repo_name|>, <|file_sep|> and the plain-text token
    "</s>" (id 128247), which llama.cpp lists for another model family."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    n = len(tokens)
    by_text = {}
    for i, text in enumerate(tokens):
        by_text.setdefault(text, i)

    def special(name: str, default: int | None = None) -> int | None:
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        chosen = value if value is not None and 0 <= value < n else default
        return chosen if chosen is not None and 0 <= chosen < n else None

    eog = {i for text, i in by_text.items() if text in EOG_TEXTS}
    for name, texts in _FIM_EOG_TEXTS.items():
        found = [by_text[t] for t in texts if t in by_text]
        if (token := special(name, min(found) if found else None)) is not None:
            eog.add(token)
    for name, default in (("eos", _DEFAULT_EOS.get(meta.get("tokenizer.ggml.model"))), ("eot", None), ("eom", None)):
        if (token := special(name, default)) is not None:
            eog.add(token)
    texts = {tokens[i] for i in eog}
    if {"<|return|>", "<|call|>", "<|end|>"} <= texts or {"<|calls|>", "<|flush|>", "<|end|>"} <= texts:
        eog.discard(by_text["<|end|>"])
    if {"<|tool_response>", "</s>"} <= texts:
        eog.discard(by_text["</s>"])
    return frozenset(eog)


# --- vocabulary digest ---------------------------------------------------------


def digest_tokens(tokens: Sequence[str]) -> str:
    """sha256 over the count and each token as GGUF stores it (u64 length, UTF-8 bytes)."""
    h = hashlib.sha256(struct.pack("<Q", len(tokens)))
    for token in tokens:
        data = token.encode("utf-8")
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    return h.hexdigest()


def vocab_digest(meta: Metadata) -> str:
    """`digest_tokens(meta.tokens)`, hashed straight from the file's bytes (no decoding)."""
    raw, count = meta.raw_bytes("tokenizer.ggml.tokens"), meta.count("tokenizer.ggml.tokens")
    if raw is None:
        return digest_tokens(meta.tokens)
    return hashlib.sha256(struct.pack("<Q", count) + raw).hexdigest()


# --- tokenizer -----------------------------------------------------------------

# tokenizer.ggml.<key> -> the name transformers' GGUF tokenizer builders read it under
# (transformers.integrations.gguf.gguf_tokenizer_mapping.GGUF_TOKENIZER_MAPPING["tokenizer"]).
_TOKENIZER_FIELDS = {
    "model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
    "token_type": "token_type", "merges": "merges", "precompiled_charsmap": "precompiled_charsmap",
    "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space",
}
SPECIAL_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                     "pad_token": "padding_token_id"}


def chat_template(meta: Metadata) -> str | None:
    return meta.get("tokenizer.chat_template")


def session_start(meta: Metadata) -> int | None:
    """The token a sequence starts with when the model asks for one (`tokenizer.ggml.add_bos_token`,
    as llama.cpp reads it: Gemma and Llama do, Qwen does not), else None."""
    if not meta.get("tokenizer.ggml.add_bos_token", False):
        return None
    return meta.get("tokenizer.ggml.bos_token_id")


def special_tokens(meta: Metadata) -> dict[str, str]:
    """bos_token, eos_token, unk_token, pad_token: the texts the file names (the chat template's
    variables, as transformers passes them)."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    found = {}
    for name, key in SPECIAL_TOKEN_IDS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokens):
            found[name] = tokens[token_id]
    return found


def tokenizer_json(meta: Metadata) -> str:
    """The file's tokenizer as a `tokenizers` JSON: what `AutoTokenizer.from_pretrained(dir,
    gguf_file=...)` builds (its own builders: byte-level BPE for `gpt2`, SentencePiece-style BPE for
    `llama`, Gemma's variant, unigram for `t5`), read from this reader's metadata so that no torch
    is imported. tests/test_model_info.py checks it against transformers on the same file."""
    from tokenizers import AddedToken
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    if "tokenizer.ggml.tokens" not in meta:
        raise GGUFError(f"{meta.path} carries no tokenizer (tokenizer.ggml.tokens)")
    fields = {name: meta.get(f"tokenizer.ggml.{key}") for key, name in _TOKENIZER_FIELDS.items()
              if f"tokenizer.ggml.{key}" in meta}
    tokenizer, _ = convert_gguf_tokenizer(meta.architecture, fields)
    # What transformers' tokenizer class adds on top when it wraps that backend: the named special
    # tokens, as special added tokens (a no-op for the ones the control list already holds).
    named = special_tokens(meta)
    tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in named.values()])
    # ... and the BOS/EOS it adds around an encoding with add_special_tokens=True (its
    # update_post_processor), as the file's add_bos_token/add_eos_token flags say.
    add_bos, add_eos = meta.get("tokenizer.ggml.add_bos_token"), meta.get("tokenizer.ggml.add_eos_token")
    if fields.get("tokenizer_type") == "llama" and add_bos is None:
        add_bos = True  # transformers, like llama.cpp, adds BOS to a sentencepiece vocabulary that does not say
    elif fields.get("tokenizer_type") == "gemma4":
        add_bos = False  # its chat template writes <bos> itself
    if add_bos is not None or add_eos is not None or tokenizer.post_processor is None:
        tokenizer.post_processor = _bos_eos_processor(tokenizer, named.get("bos_token") if add_bos else None,
                                                      named.get("eos_token") if add_eos else None)
    return tokenizer.to_str()


def _bos_eos_processor(tokenizer, bos: str | None, eos: str | None):
    from tokenizers import processors

    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    special = [(token, tokenizer.token_to_id(token)) for token in (bos, eos) if token]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
