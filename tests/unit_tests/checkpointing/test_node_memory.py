"""Memory steps in the node's shared memory (``checkpoint.memory_dir``): the staging sets are files
in a tmpfs, the held memory step has a record beside them, and a new process of the same rank
adopts it after the one holding it died (single process, real megatron-core state dicts, real files
in /dev/shm; a "new process" is this one with its held step dropped and its set files kept)."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tierstack.checkpointing import local_file, local_memory, node_memory
from tierstack.checkpointing.staging import Stager
from tierstack.config.sections import CheckpointConfig
from test_local_memory import _tasd, _template  # (this directory is on sys.path: pytest's rootdir import mode)

TOPOLOGY = {"world_size": 1}


@pytest.fixture(autouse=True)
def _group(gloo_group):  # (conftest's 1-rank gloo group, for every test here)
    yield


@pytest.fixture
def shm():
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="tierstack-test-", dir=base) as d:
        yield Path(d)


def _memory_step(stager, step: int, root: Path):
    """Stage ``step`` and seal it as a memory step (what LocalTier.save(in_memory=True) does)."""
    tasd = _tasd(float(step))
    bufs = stager.stage(tasd.pop_tensors())
    local_memory.note_staged(stager, step, local_file.encode_header(tasd, bufs))
    local_memory.note_sealed(stager, step=step, run_id="r", rank=0, root=root, topology=TOPOLOGY,
                             manifest={"step": step, "run_id": "r", "in_memory": True})


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_a_new_process_of_the_rank_adopts_the_memory_step_the_dead_one_held(tmp_path, memory, shm):
    node_dir = node_memory.rank_dir(str(shm), tmp_path, 0)
    stager = local_memory.stager_for(Stager("LOCAL"), node_dir)
    _memory_step(stager, 11, tmp_path)
    _memory_step(stager, 12, tmp_path)
    assert "held" in _files(node_dir) and len([f for f in _files(node_dir) if f.startswith("set-")]) == 2
    expected = local_memory.decode(local_memory.held(), tmp_path / "x").to_state_dict(_template(), algo="atomic")
    local_memory._held = None  # the process died: what it held in its own memory is gone; node memory stays
    cand = local_memory.memory_candidate("r", 0, tmp_path, TOPOLOGY, tmp_path / "rank_dir", node_dir)
    assert cand is not None and cand.step == 12 and cand.extra == {"in_memory": True}
    h = local_memory.match(12, "r", 0, tmp_path, TOPOLOGY)
    assert h is not None and h.manifest["step"] == 12
    got = local_memory.decode(h, tmp_path / "x").to_state_dict(_template(), algo="atomic")
    assert torch.equal(got["w"], expected["w"]) and torch.equal(got["b"], expected["b"])
    assert float(got["w"][0, 0]) == 12.0
    # another rank, root or topology never adopts it
    local_memory._held = None
    assert local_memory.memory_candidate("r", 0, tmp_path, {"world_size": 2}, tmp_path, node_dir) is None
    assert "held" not in _files(node_dir)  # of another topology: never resumable from this directory, removed


def test_the_record_always_names_a_set_that_is_not_refilled(tmp_path, memory, shm):
    node_dir = node_memory.rank_dir(str(shm), tmp_path, 0)
    stager = local_memory.stager_for(Stager("LOCAL"), node_dir)
    _memory_step(stager, 11, tmp_path)
    tasd = _tasd(99.0)  # staged, never sealed (a rank died during the agreement): the other set
    stager.stage(tasd.pop_tensors())
    local_memory._held = None
    meta, header, buffers, _ = node_memory.adopt(node_dir)
    assert meta["step"] == 11 and float(buffers[0][0, 0]) == 11.0


def test_a_newer_file_step_or_forget_removes_the_record(tmp_path, memory, shm):
    node_dir = node_memory.rank_dir(str(shm), tmp_path, 0)
    stager = local_memory.stager_for(Stager("LOCAL"), node_dir)
    _memory_step(stager, 11, tmp_path)
    tasd = _tasd(15.0)
    bufs = stager.stage(tasd.pop_tensors())
    local_memory.note_staged(stager, 15, local_file.encode_header(tasd, bufs))
    local_memory.note_sealed(stager, step=15, run_id="r", rank=0, root=tmp_path, topology=TOPOLOGY)  # a file step
    assert local_memory.held().step == 15 and "held" not in _files(node_dir)  # step 11's set may be refilled now
    _memory_step(stager, 16, tmp_path)
    assert "held" in _files(node_dir)
    local_memory.forget_newer(15)  # a rewind, or a resume of an older step
    assert "held" not in _files(node_dir)


def test_release_removes_every_file_of_the_process_and_what_dead_ones_left(tmp_path, memory, shm):
    """Also the sets a dead process of this rank left and nobody allocated after (found by a
    break-it pass: the adopter of a memory step never allocated again, so they stayed)."""
    node_dir = node_memory.rank_dir(str(shm), tmp_path, 0)
    stager = local_memory.stager_for(Stager("LOCAL"), node_dir)
    _memory_step(stager, 11, tmp_path)
    _memory_step(stager, 12, tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (node_dir / f"set-{int(dead.stdout)}-0.bin").write_bytes(b"x")  # a dead process's set, named by no record
    local_memory.release()
    assert not node_dir.exists() and not node_dir.parent.exists()  # files gone, then the empty directories


def test_release_sweeps_a_ranks_directory_this_process_never_allocated_in(tmp_path, memory, shm):
    """A process that took a rank at the run's last step (a spare after a kill at the end: nothing
    to do, nothing staged or adopted) still removes what the dead process left (found by a break-it
    pass: a 19 MB set in /dev/shm after a run that ended with exit status 0)."""
    from tierstack.checkpointing.local_tier import LocalTier
    from tierstack.runtime.distributed import ParallelLayout

    node_dir = node_memory.rank_dir(str(shm), tmp_path / "local", 0)
    node_dir.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (node_dir / f"set-{int(dead.stdout)}-1.bin").write_bytes(b"x" * 4096)  # the dead process's, no record
    cfg = CheckpointConfig(local_dir=str(tmp_path / "local"), local_save_interval=5, memory_save_interval=1,
                           memory_dir=str(shm))
    layout = ParallelLayout(rank=0, world_size=1, local_rank=0, tensor_model_parallel_size=1,
                            pipeline_model_parallel_size=1, data_parallel_size=1, tensor_model_parallel_rank=0,
                            pipeline_model_parallel_rank=0, data_parallel_rank=0)
    LocalTier(cfg, layout)  # this process's tier of rank 0: it stages nothing
    local_memory.release()  # the run's end
    assert not node_dir.exists() and not node_dir.parent.exists()


def test_a_malformed_record_does_not_stop_allocation_or_release(tmp_path, memory, shm):
    """A record that does not parse names no set: the sweep of an allocation and the release at the
    end of the run go on (the first raised the parser's RecordError, found reading the change again)."""
    node_dir = node_memory.rank_dir(str(shm), tmp_path, 0)
    node_dir.mkdir(parents=True, mode=0o700)
    (node_dir / "held").write_bytes(b"not a record")
    stager = local_memory.stager_for(Stager("LOCAL"), node_dir)
    _memory_step(stager, 11, tmp_path)  # allocates (sweeps), then replaces the record
    assert node_memory.read_record(node_dir)[0]["step"] == 11
    (node_dir / "held").write_bytes(b"not a record")
    local_memory.release()
    assert [p.name for p in node_dir.glob("set-*")] == []


def test_a_dead_processs_sets_are_swept_except_the_one_its_record_names(tmp_path, memory, shm):
    node_dir = node_memory.rank_dir(str(shm), tmp_path, 0)
    node_dir.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has exited
    for n in (0, 1):
        (node_dir / f"set-{pid}-{n}.bin").write_bytes(b"x")
    node_memory.write_record(node_dir, step=3, run_id="r", rank=0, root=str(tmp_path), topology=TOPOLOGY,
                             manifest={}, header=b"h", buffers=[torch.zeros(1, dtype=torch.uint8)],
                             file=str(node_dir / f"set-{pid}-1.bin"))
    node_memory.allocate([torch.zeros(4)], node_dir)
    names = _files(node_dir)
    assert f"set-{pid}-0.bin" not in names and f"set-{pid}-1.bin" in names and "held" in names


def test_a_record_whose_set_file_is_gone_or_truncated_is_not_adopted(tmp_path, memory, shm):
    node_dir = node_memory.rank_dir(str(shm), tmp_path, 0)
    stager = local_memory.stager_for(Stager("LOCAL"), node_dir)
    _memory_step(stager, 11, tmp_path)
    set_file = node_dir / node_memory.read_record(node_dir)[0]["file"]
    os.truncate(set_file, 100)
    local_memory._held = None
    assert local_memory.memory_candidate("r", 0, tmp_path, TOPOLOGY, tmp_path, node_dir) is None
    assert "held" not in _files(node_dir)
    (node_dir / "held").write_bytes(b"not a record")
    assert node_memory.adopt(node_dir) is None


def test_the_config_refuses_memory_dir_without_memory_steps_or_relative():
    problems = CheckpointConfig(memory_dir="shm").problems()
    assert any("checkpoint.memory_dir=shm is set but checkpoint.memory_save_interval is not" in p for p in problems)
    assert any("checkpoint.memory_dir=shm: give an absolute path" in p for p in problems)
    assert CheckpointConfig(memory_dir="/dev/shm/x", memory_save_interval=1, local_dir="/tmp/l").problems() == []


def test_a_full_memory_dir_keeps_memory_steps_in_the_process_with_a_warning(tmp_path, memory, shm, monkeypatch, caplog):
    """A tmpfs without room (ENOSPC from the reservation; a sparse file would SIGBUS at the first
    copy instead): the set is allocated in the process's memory, the memory step is still held
    in-process, and no record names a set that is not in node memory."""
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    node_dir = node_memory.rank_dir(str(shm), tmp_path, 0)
    stager = local_memory.stager_for(Stager("LOCAL"), node_dir)
    with caplog.at_level("WARNING"):
        _memory_step(stager, 11, tmp_path)
    assert local_memory.held().step == 11 and local_memory.held().record_dir is None
    assert _files(node_dir) == []
    assert "checkpoint.memory_dir no room" in caplog.text


def test_a_record_that_cannot_be_written_is_warned_about_once(tmp_path, memory, shm, monkeypatch, caplog):
    """A tmpfs that fills up after the sets were allocated: every later record fails alike (ENOSPC).
    Each memory step stays held in the process, no record names a set, and the warning comes once
    per process, not at every step (a break-it pass counted 7 in 22 steps)."""
    import errno

    from tierstack.checkpointing import paths

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(local_memory, "_warned", set())
    node_dir = node_memory.rank_dir(str(shm), tmp_path, 0)
    stager = local_memory.stager_for(Stager("LOCAL"), node_dir)
    _memory_step(stager, 10, tmp_path)
    assert (node_dir / "held").exists()
    monkeypatch.setattr(paths, "atomic_write_bytes", full)
    with caplog.at_level("WARNING"):
        for step in (11, 12, 13):
            _memory_step(stager, step, tmp_path)
            assert local_memory.held().step == step and local_memory.held().record_dir is None
    assert not (node_dir / "held").exists()  # the old one named a set that is refilled now
    assert caplog.text.count("could not be written") == 1, caplog.text


@pytest.mark.parametrize("damage", ["flip", "header", "layout", "step", "path", "foreign_dir", "old_format"])
def test_a_damaged_or_foreign_record_is_never_adopted(tmp_path, memory, shm, damage, caplog):
    """Bytes flipped in the set (same size), a damaged header, a record without its layout or with
    another step, a set file name outside the directory, a directory another user could write:
    never adopted (the file step is resumed instead), said in one warning line, and never a
    crash of the resume. Found by a break-it pass: a flipped set was adopted and trained on.
    ``old_format``: a record of format 1 (its checksum went buffer by buffer), left by a process
    of an older tierstack: refused by its magic, not read with the new checksum."""
    import json as _json

    node_dir = node_memory.rank_dir(str(shm), tmp_path, 0)
    stager = local_memory.stager_for(Stager("LOCAL"), node_dir)
    _memory_step(stager, 11, tmp_path)
    meta, header = node_memory.read_record(node_dir)
    set_file = node_dir / meta["file"]
    if damage == "flip":
        with open(set_file, "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "foreign_dir":
        os.chmod(node_dir, 0o777)
    else:
        if damage == "header":
            header = header[: len(header) // 2]
        elif damage == "layout":
            del meta["layout"]
        elif damage == "step":
            meta["step"] = 7
        elif damage == "path":
            outside = tmp_path / "victim.bin"
            outside.write_bytes(set_file.read_bytes())
            meta["file"] = str(outside)
        body = _json.dumps(meta).encode()
        magic = b"TSHELD1\n" if damage == "old_format" else node_memory.MAGIC
        (node_dir / "held").write_bytes(magic + len(body).to_bytes(8, "little") + body + header)
    local_memory._held = None
    with caplog.at_level("WARNING"):
        assert local_memory.memory_candidate("r", 0, tmp_path, TOPOLOGY, tmp_path, node_dir) is None
    assert "not adopted" in caplog.text or "not used" in caplog.text, caplog.text
    if damage == "old_format":
        assert "of another format (TSHELD1; this version reads TSHELD2)" in caplog.text, caplog.text
    assert local_memory.held() is None
    if damage == "path":
        assert (tmp_path / "victim.bin").exists()  # never mapped, never removed
    if damage == "foreign_dir":
        os.chmod(node_dir, 0o700)


def test_a_memory_dir_that_is_not_a_tmpfs_is_warned_about_once_per_process(tmp_path, caplog):
    """The LOCAL tier is built again at every in-process attempt; the warning comes once."""
    if node_memory.is_tmpfs(str(tmp_path)) is not False:
        pytest.skip(f"{tmp_path} is on a tmpfs here")
    with caplog.at_level("WARNING"):
        for _ in range(3):
            node_memory.warn_unless_tmpfs(str(tmp_path / "memory"))
    assert caplog.text.count("is not a tmpfs") == 1
