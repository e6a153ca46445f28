"""Every architecture in specd/archs.py, on tiny random-weight GGUF files written as llama.cpp writes them.

(a) At F32 the decoder's logits equal Hugging Face transformers' on the same file (its GGUF loader
    is an independent reading of the format), to 1e-4.
(b) For every stored type, every row of a multi-row pass equals the one-row step bit for bit,
    across row counts 1..16 and beside another session's rows.
Greedy speculation through the real services: tests/test_gguf_services.py.
"""

from __future__ import annotations

import pytest
import torch

from specd import archs, quants
from specd.gguf_model import GGUFModel
from tests.tiny_gguf import ARCHS as WRITTEN, hf_logits, write_tiny

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
PROMPT = [5, 17, 42, 99, 7, 256, 3, 64, 128, 11, 200, 31, 8, 150, 77, 90]


def test_the_tiny_writer_covers_every_architecture():
    assert set(archs.ARCHS) <= set(WRITTEN)


@pytest.mark.parametrize("arch", sorted(archs.ARCHS))
def test_f32_logits_equal_transformers(tmp_path, arch):
    path = write_tiny(tmp_path / f"{arch}.gguf", arch, "F32")
    model = GGUFModel(path)
    ours = model.forward([model.new_cache()], [PROMPT], [len(PROMPT)])[0]
    theirs = hf_logits(path, PROMPT)
    assert ours.shape == theirs.shape
    assert ours.std() > 1e-3  # not a constant: the comparison means something
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_a_head_dim_off_the_attention_s_four_chunk_stride_equals_transformers(tmp_path):
    """Attention sums a head's values 32 columns at a time and the rest 8 at a time: head_dim 40
    takes both paths (every tiny arch above has a multiple of 32)."""
    path = write_tiny(tmp_path / "llama.gguf", "llama", "F32", head_dim=40)
    model = GGUFModel(path)
    ours = model.forward([model.new_cache()], [PROMPT], [len(PROMPT)])[0]
    torch.testing.assert_close(ours, hf_logits(path, PROMPT), rtol=0, atol=1e-4)


def test_an_intermediate_off_the_gate_s_eight_value_chunks_equals_transformers_and_one_row_steps(tmp_path):
    """The gated activation runs 8 values at a time and a row's tail padded through the same code:
    intermediate 100 ends each row on 4 (every tiny arch above has a multiple of 8)."""
    model = GGUFModel(write_tiny(tmp_path / "llama.gguf", "llama", "F32", intermediate=100))
    ours = model.forward([model.new_cache()], [PROMPT], [len(PROMPT)])[0]
    torch.testing.assert_close(ours, hf_logits(model.path, PROMPT), rtol=0, atol=1e-4)
    together = model.forward([model.new_cache()], [PROMPT[:9]], [5])[0]  # its last 5 rows
    assert torch.equal(together, _steps(model, PROMPT[:4], PROMPT[4:9]))


def _steps(model: GGUFModel, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    cache = model.new_cache()
    model.forward([cache], [prefix], [1])
    return torch.cat([model.forward([cache], [[t]], [1])[0] for t in tokens])


@pytest.mark.parametrize("tensor_type", TYPES)
@pytest.mark.parametrize("arch", sorted(archs.ARCHS))
def test_rows_of_a_pass_equal_one_row_steps(tmp_path, arch, tensor_type):
    model = GGUFModel(write_tiny(tmp_path / f"{arch}-{tensor_type}.gguf", arch, tensor_type))
    prefix, tokens = PROMPT[:3], PROMPT[3:] + PROMPT[:3]
    alone = _steps(model, prefix, tokens)  # [16, vocab]
    for rows in range(1, len(tokens) + 1):
        cache, neighbour = model.new_cache(), model.new_cache()
        model.forward([cache, neighbour], [prefix, PROMPT[::-1]], [1, 1])
        together = model.forward([neighbour, cache], [PROMPT[:rows], tokens[:rows]], [rows, rows])[1]
        assert torch.equal(together, alone[:rows]), f"{rows} rows"


def test_an_unsupported_architecture_is_refused_with_its_name(tmp_path):
    path = write_tiny(tmp_path / "llama.gguf", "llama", "F32")
    renamed = path.read_bytes().replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00mamba")
    assert renamed != path.read_bytes()
    path.write_bytes(renamed)
    with pytest.raises(archs.UnsupportedArchitecture, match="'mamba' is not supported"):
        GGUFModel(path)


def test_a_tensor_type_without_a_kernel_is_refused_naming_the_tensor(tmp_path):
    path = write_tiny(tmp_path / "qwen2.gguf", "qwen2", "F32")
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)  # then n_dims, dims, type
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at:type_at + 4] = (10).to_bytes(4, "little")  # Q2_K: smaller than the F32 bytes it replaces
    path.write_bytes(bytes(data))
    with pytest.raises(quants.UnsupportedTensorType, match="blk.0.attn_q.weight has type Q2_K"):
        GGUFModel(path)
