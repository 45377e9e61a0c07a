"""The block file, the one on-disk format of a K/V block (disk tiers and persisted handles): a block
comes back bit-identical or not at all, and a failed write leaves nothing behind."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from kvbaton.backend.cache import blockfile
from kvbaton.backend.cache.blockfile import BlockDataError

pytestmark = pytest.mark.unit


def block() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 4, 16, 8, generator=g, dtype=torch.float32).to(torch.bfloat16),
            torch.randn(2, 4, 16, 8, generator=g, dtype=torch.float32).to(torch.bfloat16))


def test_a_block_round_trips_bit_identical_under_its_checksum(tmp_path):
    k, v = block()
    path = tmp_path / "7.safetensors"
    crc = blockfile.write(path, k, v)
    assert crc == blockfile.checksum(k, v)
    k2, v2 = blockfile.read(path, crc)
    assert torch.equal(k2, k) and torch.equal(v2, v) and k2.dtype == torch.bfloat16
    assert [p.name for p in tmp_path.iterdir()] == ["7.safetensors"], "no temporary is left"


def test_a_missing_file_is_a_block_data_error(tmp_path):
    with pytest.raises(BlockDataError, match="could not be read"):
        blockfile.read(tmp_path / "absent.safetensors", 0)


def test_a_truncated_file_is_a_block_data_error(tmp_path):
    path = tmp_path / "1.safetensors"
    crc = blockfile.write(path, *block())
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(BlockDataError, match="could not be read"):
        blockfile.read(path, crc)


def test_a_flipped_byte_fails_the_checksum(tmp_path):
    path = tmp_path / "1.safetensors"
    crc = blockfile.write(path, *block())
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # a K/V byte: the header still parses
    path.write_bytes(bytes(data))
    with pytest.raises(BlockDataError, match="corrupted"):
        blockfile.read(path, crc)


def test_a_failed_write_leaves_no_file_keeps_the_old_block_and_says_enospc(tmp_path, monkeypatch):
    path = tmp_path / "1.safetensors"
    old_crc = blockfile.write(path, *block())
    real_write = os.write

    def nearly_full(fd, data):  # what a nearly full disk does: part of the write, then ENOSPC
        if len(data) > 64:
            return real_write(fd, bytes(data[:64]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("kvbaton.backend.cache.volume.os.write", nearly_full)  # the disk, not the engine
    k, v = block()
    for target in (path, tmp_path / "2.safetensors"):
        with pytest.raises(OSError) as failed:
            blockfile.write(target, k + 1, v)
        assert failed.value.errno == errno.ENOSPC, "a full disk is told as such: the caller may give space back"
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1.safetensors"]
    assert torch.equal(blockfile.read(path, old_crc)[0], k), "the block written before is intact"


def test_size_bounds_what_a_block_file_takes(tmp_path):
    k, v = block()
    path = tmp_path / "1.safetensors"
    blockfile.write(path, k, v)
    assert path.stat().st_size <= blockfile.size(k.nbytes + v.nbytes)
