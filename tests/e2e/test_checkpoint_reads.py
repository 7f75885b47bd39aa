"""A reader fetches only the byte ranges of the shards it uses, and checks each against its own checksum —
on a local disk and on S3 (moto's server on loopback, see s3_server.py)."""

from __future__ import annotations

import re

import pytest
import torch
from log_helpers import logged

from nanoflow.io import CheckpointReader, DamagedCheckpointError, checkpoint, read_checkpoint, save_checkpoint
from nanoflow.io.store import Store, StoreError
from nanoflow.io.tensorfile import HEAD_GUESS as _HEAD_GUESS
from nanoflow.io.tensorfile import header_length, parse_header

MODEL = "model/rank00000.safetensors"


def info(step: int) -> dict:
    return {"training": {"completed": step}}


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(256, 256, generator=g), "b": torch.randn(256, 256, generator=g),   # 256 KiB each
            "c": torch.randn(3, generator=g)}


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    """(run folder, endpoint or None): one step saved there, with the tensors of `tensors()`."""
    if request.param == "local":
        root, endpoint = str(tmp_path / "run"), None
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        root = request.getfixturevalue("s3_bucket")
    save_checkpoint(root, 1, {"model": tensors()}, info(1))
    return root, endpoint


def recorded(reader: CheckpointReader) -> list[tuple[str, int, int]]:
    """The (file, start, length) of every range the reader asks its store for, from now on."""
    asked, read_range = [], reader.store.read_range

    def recording(relative, start, length):
        asked.append((relative, start, length))
        return read_range(relative, start, length)

    reader.store.read_range = recording
    return asked


def byte_range(root: str, name: str) -> tuple[int, int]:
    """Where tensor `name`'s bytes lie in the model file, from the file's own header."""
    data = Store(f"{root}/1").read(MODEL)
    begin, end = parse_header(data, len(data))[name]["data_offsets"]
    return header_length(data) + begin, header_length(data) + end


def test_a_box_is_fetched_from_its_own_shard_alone(where):
    root, endpoint = where
    start, end = byte_range(root, "b")
    reader = CheckpointReader(f"{root}/1")
    asked = recorded(reader)
    if endpoint is not None:
        endpoint.requests.clear()
    box = reader.read("model", "b", (16, 0), (32, 256))
    assert torch.equal(box, tensors()["b"][16:48])
    header, *data = asked
    assert header == (MODEL, 0, _HEAD_GUESS)                # the header first, in one small read ...
    assert data == [(MODEL, start, end - start)]            # ... then b's bytes, and nothing of a or c
    if endpoint is not None:                                # and S3 was asked for those bytes only
        gets = [r for m, path, r in endpoint.requests if m == "GET" and path.endswith(MODEL)]
        assert gets == [f"bytes=0-{_HEAD_GUESS - 1}", f"bytes={start}-{end - 1}"]


def test_reading_everything_takes_one_range_after_the_header(where):
    root, _ = where
    reader = CheckpointReader(f"{root}/1")
    asked = recorded(reader)
    reader.fetch(("model", name, None, None) for name in reader.names("model"))
    got = {name: reader.read("model", name) for name in reader.names("model")}
    assert got.keys() == tensors().keys() and all(torch.equal(got[n], t) for n, t in tensors().items())
    assert len(asked) == 2                                   # the neighbours come in one run
    assert asked[1][2] == sum(t.numel() * 4 for t in tensors().values())
    assert not reader._fetched                               # every fetched shard was handed out and dropped


def flip_a_byte_of_b(root: str, endpoint) -> None:
    start, end = byte_range(root, "b")
    store = Store(f"{root}/1")
    data = bytearray(store.read(MODEL))
    data[(start + end) // 2] ^= 0xFF
    store.write(MODEL, bytes(data))                          # same size: only a checksum can tell


def test_damage_is_found_in_the_shard_that_holds_it(where):
    root, endpoint = where
    flip_a_byte_of_b(root, endpoint)
    reader = CheckpointReader(f"{root}/1")
    assert torch.equal(reader.read("model", "a"), tensors()["a"])     # a's bytes are intact, and all it reads
    with pytest.raises(DamagedCheckpointError, match=re.escape(f"{root}/1/{MODEL} is damaged (the bytes of b ")):
        reader.read("model", "b", (0, 0), (1, 1))
    with pytest.raises(DamagedCheckpointError, match="is damaged"):
        read_checkpoint(f"{root}/1", groups=("model",))               # a step folder named alone: no fallback
    with pytest.raises(DamagedCheckpointError, match="the bytes of b "):
        CheckpointReader(f"{root}/1").verify()                        # the check of every byte sees it too


def test_fill_reads_each_saved_box_straight_into_its_tensor(where):
    """A restore's boxes, saved as asked, go from a local file into the tensors' own memory: no buffer of
    tensor bytes is read and then copied (on S3 one run of neighbours still comes in one ranged GET)."""
    root, endpoint = where
    reader = CheckpointReader(f"{root}/1")
    asked = recorded(reader)
    targets = {name: torch.empty_like(t) for name, t in tensors().items()}
    reader.fill(("model", name, None, None, t) for name, t in targets.items())
    assert all(torch.equal(targets[n], t) for n, t in tensors().items())
    if endpoint is None:
        assert asked == [(MODEL, 0, _HEAD_GUESS)]            # the header alone came through a buffer
    else:
        assert len(asked) == 2 and asked[1][2] == sum(t.numel() * 4 for t in tensors().values())


def test_fill_copies_a_box_that_was_not_saved_as_asked(where):
    root, _ = where
    box = torch.empty(32, 256)
    CheckpointReader(f"{root}/1").fill([("model", "b", (16, 0), (32, 256), box)])
    assert torch.equal(box, tensors()["b"][16:48])


def test_fill_checks_the_bytes_it_read_into_the_tensor(where):
    root, endpoint = where
    flip_a_byte_of_b(root, endpoint)
    a, b = torch.empty(256, 256), torch.empty(256, 256)
    with pytest.raises(DamagedCheckpointError, match=re.escape(f"{root}/1/{MODEL} is damaged (the bytes of b ")):
        CheckpointReader(f"{root}/1").fill([("model", "a", None, None, a), ("model", "b", None, None, b)])


def test_a_header_changed_after_the_save_is_refused(tmp_path):
    root = str(tmp_path / "run")
    save_checkpoint(root, 1, {"model": tensors()}, info(1))
    path = tmp_path / "run" / "1" / MODEL
    data = path.read_bytes()
    assert data.count(b'"shape":[3]') == 1
    path.write_bytes(data.replace(b'"shape":[3]', b'"shape":[2]'))  # still parses; c now claims fewer elements
    with pytest.raises(DamagedCheckpointError, match="its header differs from its checksum"):
        CheckpointReader(f"{root}/1").read("model", "a")


def test_a_header_longer_than_the_first_read_is_read_whole(tmp_path):
    many = {f"layer{i}.weight": torch.full((3,), float(i)) for i in range(1200)}     # a header of > 64 KiB
    save_checkpoint(str(tmp_path / "run"), 1, {"model": many}, info(1))
    data = (tmp_path / "run" / "1" / MODEL).read_bytes()
    assert header_length(data) > _HEAD_GUESS
    reader = CheckpointReader(str(tmp_path / "run" / "1"))
    assert torch.equal(reader.read("model", "layer1199.weight"), many["layer1199.weight"])
    assert all(torch.equal(t, many[n]) for n, t in read_checkpoint(str(tmp_path / "run"), ("model",)).groups["model"].items())


def test_retention_deletes_nothing_while_a_metadata_file_cannot_be_read(tmp_path, monkeypatch):
    root = str(tmp_path / "run")
    for step in (1, 2):
        save_checkpoint(root, step, {"model": tensors()}, info(step))
    read = Store.read

    def failing(self, relative):
        if relative == "1/checkpoint_metadata.json":
            raise StoreError("injected: the store did not answer")
        return read(self, relative)

    monkeypatch.setattr(Store, "read", failing)
    monkeypatch.setattr(checkpoint, "_COMMITTED", {})                # a new process: no commit time known yet
    with logged() as warned:
        save_checkpoint(root, 3, {"model": tensors()}, info(3), keep=1)   # cannot tell when 1 was committed
    assert any(w.endswith("; deleting no old checkpoint this time") for w in warned), warned
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.isdigit()) == ["1", "2", "3"]
    monkeypatch.setattr(Store, "read", read)
    save_checkpoint(root, 4, {"model": tensors()}, info(4), keep=1)       # now it can: only the newest stays
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.isdigit()) == ["4"]
