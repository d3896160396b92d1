"""vlens.tensor_file writes the safetensors library's bytes, with one copy of each tensor."""

import io
import json

import pytest
import torch
from safetensors.torch import load, save

from vlens.tensor_file import dump, encode


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g)
    return {
        "blocks.0.hook_resid_post": x.to(torch.bfloat16),
        "b.half": x.half(), "a.f32": x, "f64": x.double()[:2], "strided": x.t(), "scalar": torch.tensor(3),
        "empty": torch.zeros(0, 4, dtype=torch.int64), "i32": torch.arange(6, dtype=torch.int32).view(2, 3),
        "i16": torch.arange(3, dtype=torch.int16), "i8": torch.arange(3, dtype=torch.int8), "u8": torch.arange(4, dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]), "fp8": x[0].to(torch.float8_e4m3fn), "ü/ñame": x[1],
    }  # fmt: skip


def _split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


@pytest.mark.parametrize(
    "metadata", [None, {}, {"model": "m"}, {"model": "m", "texts": '["caf\\u00e9"]', "raw": 'é\n\t\x01\x7f"\\'}]
)
def test_bytes_equal_the_safetensors_librarys(metadata):
    tensors = _tensors()
    theirs = save({k: v.clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}, metadata=metadata)
    ours = bytes(encode(tensors, metadata))
    f = io.BytesIO()
    assert dump(tensors, f, metadata) == len(ours) and f.getvalue() == ours
    if metadata is None or len(metadata) < 2:
        assert ours == theirs
    else:  # the library lays metadata out in a hash map's order (it varies between runs); ours is as given
        assert len(ours) == len(theirs) and _split(ours) == _split(theirs)
        assert list(_split(ours)[0]["__metadata__"]) == list(metadata)
    back = load(ours)
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(
            back[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)
        )


def test_tensors_that_share_memory_are_each_written():
    x = torch.arange(4.0)
    back = load(bytes(encode({"a": x, "alias": x, "half": x[2:]})))
    assert torch.equal(back["a"], x) and torch.equal(back["alias"], x) and torch.equal(back["half"], x[2:])


def test_a_dtype_safetensors_cannot_name_is_refused_by_name():
    allowed = r"\(it has: uint64, int64, .*, bool\)"
    with pytest.raises(ValueError, match=rf"c: dtype torch.complex64 has no safetensors name {allowed}"):
        encode({"c": torch.zeros(2, dtype=torch.complex64)})
