"""The shard file is a safetensors file: its header is padded to 8 bytes (the states start
aligned), and safetensors' own reader gives back the tensors open_shard serves; fp8 rows' peaks
read back exactly; a file shorter than the 8-byte header length is a truncated shard."""

import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open

from eagle3lib import shard_writer, shards
from eagle3lib.errors import UserError


def write_shard(path, lengths, slots, hidden, storage):
    layout = shards.ShardLayout(lengths, slots, hidden, storage=storage)
    writer = shard_writer.ShardWriter(path, layout, {"format": "test"})
    gen = torch.Generator().manual_seed(len(lengths))
    for i in layout.put_order:
        writer.put_states(i, torch.randn(lengths[i], slots, hidden, generator=gen))
    tokens = layout.tokens
    writer.close(np.arange(tokens) % 7, (np.arange(tokens) % 2).astype(np.uint8))


# Catches: the header written without its padding to a multiple of 8 bytes (a file
# safetensors' spec and aligned mmap views of the states rely on).
@pytest.mark.parametrize("storage", ["bf16", "fp8"])
@pytest.mark.parametrize("lengths", [(3,), (3, 2), (5, 1, 4), (17, 9, 2, 11)])
def test_shard_header_is_padded_and_safetensors_reads_what_open_shard_serves(
    tmp_path, lengths, storage
):
    path = tmp_path / "s.safetensors"
    write_shard(path, lengths, 3, 8, storage)
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert n % 8 == 0, f"header of {n} bytes: states start unaligned"
    shard = shards.open_shard(path)
    with safe_open(path, "pt") as f:
        assert torch.equal(
            f.get_tensor("hidden_states").view(torch.uint8),
            shard.hidden_states.view(torch.uint8),
        )
        assert f.get_tensor("input_ids").tolist() == shard.input_ids.tolist()
        assert f.get_tensor("offsets").tolist() == shard.offsets.tolist()
        assert f.get_tensor("row_starts").tolist() == shard.row_starts.tolist()
        if storage == "fp8":
            assert torch.equal(f.get_tensor("hidden_scales"), torch.from_numpy(shard.scales))


# Catches: FP8_MAX off e4m3's largest value (449, 447): every row's largest |value| still maps
# to e4m3's 448, but reads back as 448/449 (or 448/447) of itself, 0.2 % off.
def test_fp8_rows_largest_value_reads_back_as_itself():
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 3, 32, generator=gen) * torch.logspace(-2, 2, 4)[:, None, None]).bfloat16()
    back = shards.dequantize_fp8(*shards.quantize_fp8(x), torch.float32)
    torch.testing.assert_close(back.abs().amax(-1), x.float().abs().amax(-1), rtol=1e-6, atol=0)


# Catches: the header-length check at 7 bytes: a 7-byte file then fails in struct.unpack
# instead of naming the truncated shard.
def test_a_seven_byte_shard_is_truncated(tmp_path):
    path = tmp_path / "s.safetensors"
    path.write_bytes(b"\x08" + bytes(6))
    with pytest.raises(UserError, match=r"s.safetensors: truncated shard \(no header\)"):
        shards.read_header(path)
