"""The shard format itself, in one process (write_all_ranks writes every TP rank's file): a tensor
split with a partition stride (GPT-2's c_attn: q, k and v side by side, each rank its 1/tp of each)
is stored as one contiguous range of the full tensor per record, and reads back at any TP degree and
stride, whole, or into a contiguous split, against slices built by hand with torch.chunk."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from parallel_latent.checkpoint import CheckpointError
from parallel_latent.checkpoint.shards import (
    Entry,
    Placement,
    PortableCheckpoint,
    placement_of,
    rank_file_name,
    write_all_ranks,
)
from parallel_latent.parallel.utils import set_tensor_parallel_attributes

DIM, STRIDE = 1, 3
FULL = torch.arange(5 * 36, dtype=torch.float32).reshape(5, 36)  # [in, out]: 3 parts of 12 columns
WHOLE = Placement(None, tuple(FULL.shape), tuple(FULL.shape))  # a replicated tensor


def strided_slice(tp: int, rank: int, stride: int = STRIDE) -> torch.Tensor:
    """Rank ``rank``'s 1/tp of each of the ``stride`` parts of FULL, concatenated."""
    return torch.cat([part.chunk(tp, DIM)[rank] for part in FULL.chunk(stride, DIM)], DIM)


def placement(tp: int, stride: int) -> Placement:
    local = list(FULL.shape)
    local[DIM] //= tp
    return Placement(DIM, tuple(local), tuple(FULL.shape), stride)


def save(directory, tp: int, stride: int, name: str = "c_attn.weight") -> PortableCheckpoint:
    entries = [
        [Entry(name, FULL.dtype, placement(tp, stride), lambda r=r: strided_slice(tp, r, stride))] for r in range(tp)
    ]
    write_all_ranks(directory, entries, "model", {}, {})
    return PortableCheckpoint(directory)


@pytest.fixture(scope="module")
def strided(tmp_path_factory):
    return save(tmp_path_factory.mktemp("shards") / "tp2-stride3", 2, STRIDE)


def test_a_strided_split_is_stored_as_contiguous_ranges_of_the_full_tensor(strided):
    info = strided.tensors["c_attn.weight"]
    assert info["shape"] == [5, 36] and info["partition_dim"] == DIM
    # Each part of 12 columns halved: rank 0 holds [0, 6), [12, 18), [24, 30); rank 1 the others.
    ranges = [(s["offset"], s["length"], s["file"]) for s in info["shards"]]
    assert ranges == [(offset, 6, rank_file_name("model", offset // 6 % 2, 2)) for offset in range(0, 36, 6)]
    for shard in info["shards"]:
        with safe_open(str(strided.directory / shard["file"]), framework="pt") as handle:
            stored = handle.get_tensor(shard["key"])
        assert torch.equal(stored, FULL[:, shard["offset"] : shard["offset"] + shard["length"]])
    assert json.loads((strided.directory / "manifest.json").read_text())["format_version"] == 3


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_a_strided_save_reads_at_any_tp(strided, tp, verify):
    checkpoint = PortableCheckpoint(strided.directory, verify_checksums=verify)
    for rank in range(tp):
        got = checkpoint.read_block("c_attn.weight", placement(tp, STRIDE), rank)
        assert torch.equal(got, strided_slice(tp, rank)), (tp, rank)
    assert torch.equal(checkpoint.read_full("c_attn.weight"), FULL)
    assert torch.equal(checkpoint.read_block("c_attn.weight", WHOLE, 0), FULL)


@pytest.mark.parametrize("tp", [2, 3])
def test_a_strided_save_reads_into_a_contiguous_split_and_back(strided, tmp_path, tp):
    for rank in range(tp):
        got = strided.read_block("c_attn.weight", placement(tp, 1), rank)
        assert torch.equal(got, FULL.chunk(tp, DIM)[rank]), (tp, rank)
    contiguous = save(tmp_path / "tp4", 4, 1)
    assert all("key" not in shard for shard in contiguous.tensors["c_attn.weight"]["shards"])
    for rank in range(tp):
        assert torch.equal(contiguous.read_block("c_attn.weight", placement(tp, STRIDE), rank), strided_slice(tp, rank))


def test_a_replicated_save_is_cut_into_strided_ranges(tmp_path):
    write_all_ranks(tmp_path / "whole", [[Entry("c_attn.weight", FULL.dtype, WHOLE, lambda: FULL)]], "model", {}, {})
    checkpoint = PortableCheckpoint(tmp_path / "whole")
    for rank in range(4):
        assert torch.equal(checkpoint.read_block("c_attn.weight", placement(4, STRIDE), rank), strided_slice(4, rank))


def test_a_damaged_strided_range_fails_its_checksum(tmp_path):
    checkpoint = save(tmp_path / "tp2", 2, STRIDE)
    info = checkpoint.tensors["c_attn.weight"]
    info["shards"][3]["xxh3_128"] = "0" * 32  # rank 1's second range
    with pytest.raises(CheckpointError, match=r"checksum mismatch for tensor 'c_attn\.weight\[18:24\]'"):
        checkpoint.read_block("c_attn.weight", placement(2, STRIDE), 1)


def test_placements_carry_the_stride():
    weight = torch.zeros(5, 18)
    set_tensor_parallel_attributes(weight, True, DIM, STRIDE)
    place = placement_of(weight, 2, "c_attn.weight")
    assert place == placement(2, STRIDE)
    assert Placement.from_spec(json.loads(json.dumps(place.spec()))) == place
    # A table written before strides were recorded: every split contiguous.
    older = {k: v for k, v in place.spec().items() if k != "partition_stride"}
    assert Placement.from_spec(older).partition_stride == 1
    weight.partition_valid_size = 30  # a padded vocabulary
    with pytest.raises(CheckpointError, match=r"^head\.weight: partition_stride=3 with a padded partition dim"):
        placement_of(weight, 2, "head.weight")


def test_a_save_without_strides_is_version_2_and_reads(tmp_path):
    """Version 2 has no keys (one range per rank and tensor, under the tensor's name): a save with no
    strided tensor says 2, so a reader that predates strides still takes it."""
    checkpoint = save(tmp_path / "tp4", 4, 1)
    manifest = json.loads((checkpoint.directory / "manifest.json").read_text())
    assert manifest["format_version"] == 2
    assert not [s for info in manifest["tensors"].values() for s in info["shards"] if "key" in s]
    assert torch.equal(PortableCheckpoint(checkpoint.directory).read_full("c_attn.weight"), FULL)
