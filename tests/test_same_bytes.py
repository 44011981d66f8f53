"""The tests' byte-equality check: silent on equal files, and on a difference a short message
naming the files, the first differing offset and the safetensors parts that differ."""

import pytest
import torch
from conftest import assert_same_bytes
from safetensors.torch import save_file


def test_equal_files_pass_and_a_changed_tensor_is_named(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    tensors = {"d2t": torch.arange(4), "t2d": torch.tensor([True, False, True])}
    save_file(tensors, str(a))
    save_file(tensors, str(b))
    assert_same_bytes(a, b)
    assert_same_bytes(a, b.read_bytes())

    save_file({**tensors, "t2d": torch.tensor([True, True, True])}, str(b))
    with pytest.raises(AssertionError) as failed:
        assert_same_bytes(a, b, "vocab map")
    message = str(failed.value)
    size = a.stat().st_size
    assert message.startswith(f"vocab map: {a} against {b}: {size} and {size} bytes, 1 differ,")
    assert message.endswith("safetensors parts that differ: t2d (BOOL [3])")
    assert "\n" not in message and len(message) < 400


def test_other_files_get_the_offset_and_sizes():
    with pytest.raises(
        AssertionError,
        match=r"^bytes kept against bytes kept: 3 and 4 bytes, 2 differ, the first at offset 1$",
    ):
        assert_same_bytes(b"abc", b"aXcd")
