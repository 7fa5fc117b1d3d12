"""Staging buffers and the LOCAL file format: single process, real tensors, real files.

The hazards of issue 8 each have a test here: the copy into the buffers is what decouples the
written bytes from training tensors (on CPU too); buffers are reused, so resident memory does not
grow with the number of saves; a slow writer keeps the buffers until it is done; a damaged file is
detected from the one read that loads it.
"""

import io
import threading
import time
import zlib

import psutil
import pytest
import torch

from tierstack.checkpointing import local_file, manifest
from tierstack.checkpointing.staging import Stager


@pytest.fixture
def gloo_group(tmp_path):
    """A 1-rank gloo process group (file store: no port needed), torn down afterwards."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 32, generator=g),
        "b": torch.randn(32, generator=g).to(torch.bfloat16),
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.rand(5, generator=g) > 0.5,
    }


# ------------------------------------------------------------------ staging
def test_buffers_are_allocated_once_and_decouple_host_tensors():
    """CPU tensors are 'already on the host': the copy into the buffers is still made, so what the
    writer reads is the state at hand-off, not what the next optimizer step writes in place."""
    st = Stager("test")
    state = _state()
    first = st.stage(list(state.values()))
    expected = [t.clone() for t in state.values()]
    for t in state.values():
        t.add_(1) if t.dtype != torch.bool else t.logical_not_()  # the next step changes the tensors in place
    assert all(torch.equal(b, e) for b, e in zip(first, expected))
    assert all(b.data_ptr() != t.data_ptr() for b, t in zip(first, state.values()))
    second = st.stage(list(state.values()))
    assert [b.data_ptr() for b in second] == [b.data_ptr() for b in first]  # reused, refilled
    assert all(torch.equal(b, t) for b, t in zip(second, state.values()))
    assert st.allocations == 1
    assert st.nbytes == sum(t.numel() * t.element_size() for t in state.values())
    st.close()
    assert st.nbytes == 0


def test_a_slow_writer_keeps_the_buffers_until_it_is_done():
    """The next stage() waits for the writer: the writer never sees half-refilled buffers."""
    st = Stager("test")
    t = torch.zeros(1 << 20)
    bufs = st.stage([t])
    seen = {}

    def slow_writer(b):
        first = b[0].clone()
        time.sleep(0.5)  # training refills meanwhile, if it may
        seen["torn"] = not torch.equal(b[0], first.expand_as(b[0]))
        seen["value"] = float(b[0][0])
        return "written"

    job = st.submit(slow_writer, bufs)
    t.fill_(1.0)
    t0 = time.perf_counter()
    st.stage([t])  # must wait for slow_writer
    waited = time.perf_counter() - t0
    assert job.done() and job.result() == "written"
    assert seen == {"torn": False, "value": 0.0}
    assert waited > 0.2
    assert float(bufs[0][0]) == 1.0
    with pytest.raises(RuntimeError, match="in flight"):
        st.submit(time.sleep, 0.3)
        st.submit(time.sleep, 0.3)
    st.close()
    assert not [th for th in threading.enumerate() if th.name.startswith("tierstack-test-writer")]


def test_resident_memory_does_not_grow_with_saves(tmp_path):
    """Save 20 times a 64 MiB state through the staging buffers and the LOCAL writer: the resident
    memory after save 20 equals that after save 2 within 16 MiB (a leak would add 64 MiB a save)."""
    st = Stager("test")
    state = [torch.randn(8 << 20) for _ in range(2)]  # 64 MiB
    proc = psutil.Process()
    rss = {}
    for n in range(1, 21):
        for t in state:
            t.add_(1.0)
        bufs = st.stage(state)
        header = local_file.encode_header({"n": n}, bufs)
        st.submit(local_file.write, tmp_path / f"iter_{n:07d}_0_local.pt", header, bufs).result()
        (tmp_path / f"iter_{n - 1:07d}_0_local.pt").unlink(missing_ok=True)
        rss[n] = proc.memory_info().rss
    st.close()
    assert rss[20] - rss[2] < 16 << 20, {k: v >> 20 for k, v in rss.items()}


# ------------------------------------------------------------------ LOCAL file
def _tasd(seed=0):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    sd = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in _state(seed).items()}
    sd["common"] = {"lr": 0.1, "iteration": 3}
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(sd, algo="atomic")
    return tasd


def _template():
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sd = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in _state().items()}
    sd["common"] = {}
    return sd


def _write(tmp_path, stager, seed=0):
    tasd = _tasd(seed)
    bufs = stager.stage(tasd.pop_tensors())
    path = tmp_path / "iter_0000003_0_local.pt"
    entry = local_file.write(path, local_file.encode_header(tasd, bufs), bufs)
    return path, entry


def test_local_file_round_trip_with_one_read(tmp_path, gloo_group):
    path, entry = _write(tmp_path, Stager("test"))
    assert not list(tmp_path.glob("*.dirty*"))
    assert entry["size"] == path.stat().st_size and manifest.entry_algo(entry) == "crc32c"
    assert entry["crc32c"] == manifest.checksum_file(path)  # computed while writing == from disk
    data = local_file.read_verified(path, entry)
    loaded = local_file.decode(data, path).to_state_dict(_template(), algo="atomic")
    for k, v in _state().items():
        assert torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype, k
    assert loaded["common"] == {"lr": 0.1, "iteration": 3}
    # the tensors are views of the buffer that was read (no second copy)
    assert loaded["w"].untyped_storage().data_ptr() == data.untyped_storage().data_ptr()


def test_damaged_or_truncated_local_file_is_refused(tmp_path, gloo_group):
    path, entry = _write(tmp_path, Stager("test"))
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit in the tensor bytes
    path.write_bytes(bytes(raw))
    with pytest.raises(local_file.LocalFileError, match="^checksum-mismatch"):
        local_file.read_verified(path, entry)
    path.write_bytes(bytes(raw[:-64]))
    with pytest.raises(local_file.LocalFileError, match="^size-mismatch"):
        local_file.read_verified(path, entry)


def test_format_1_local_file_with_crc32_manifest_still_loads(tmp_path, gloo_group):
    """A file NVRx wrote (torch.save of the whole state dict) with a format-1 manifest entry."""
    tasd = _tasd()
    buf = io.BytesIO()
    torch.save(tasd, buf)
    path = tmp_path / "iter_0000003_0_local.pt"
    path.write_bytes(buf.getvalue())
    entry = {"size": path.stat().st_size, "crc32": zlib.crc32(buf.getvalue())}
    loaded = local_file.decode(local_file.read_verified(path, entry), path).to_state_dict(_template(), algo="atomic")
    assert torch.equal(loaded["w"], _state()["w"])
    assert manifest.check_files(tmp_path, {path.name: entry}) is None
    entry["crc32"] ^= 1
    assert manifest.check_files(tmp_path, {path.name: entry}) == f"checksum-mismatch {path.name}"


def test_a_local_write_error_names_the_file(tmp_path, monkeypatch):
    """ENOSPC from ``os.write`` carries no path; the error the rank reports must name the file."""
    import errno as errno_mod

    from tierstack.checkpointing import errors

    def full(fd, data):
        raise OSError(errno_mod.ENOSPC, "No space left on device")

    bufs = [torch.ones(16)]
    path = tmp_path / "iter_0000003_0_local.pt"
    monkeypatch.setattr(local_file.os, "write", full)
    with pytest.raises(OSError) as info:
        local_file.write(path, b"header", bufs)
    line = errors.describe(info.value)
    assert line.startswith("ENOSPC") and "iter_0000003_0_local.dirty.pt" in line, line
    assert errors.classify(info.value) != errors.TRANSIENT


def _mapped(path) -> bool:
    return any(str(path) in line for line in open("/proc/self/maps"))


def test_mapped_read_is_private_and_released(tmp_path, gloo_group):
    """The verified bytes are the file's page-cache pages, mapped privately: writing into a loaded
    tensor (Adam updating a moment in place) never reaches the file, and the mapping goes with the
    last tensor that views it. The buffered fallback (kernels without MADV_POPULATE_READ) reads the
    same bytes."""
    path, entry = _write(tmp_path, Stager("test"))
    on_disk = path.read_bytes()
    data = local_file.read_verified(path, entry)
    assert _mapped(path)
    w = local_file.decode(data, path).to_state_dict(_template(), algo="atomic")["w"]
    w.add_(1.0)
    assert path.read_bytes() == on_disk
    assert manifest.checksum_file(path) == entry["crc32c"]
    del data, w
    import gc

    gc.collect()
    assert not _mapped(path)
    try:
        manifest._populate_works = False
        assert bytes(local_file.read_verified(path, entry).numpy()) == on_disk
    finally:
        manifest._populate_works = None


@pytest.mark.parametrize("held_buffers", [False, True])
def test_loaded_optimizer_state_is_copied_back_into_the_optimizers_own_tensors(held_buffers):
    """torch's ``Optimizer.load_state_dict`` keeps loaded tensors of matching dtype and device as
    they are: after a LOCAL load they would be views of the mapped file. ``own_optimizer_state``
    copies them into the tensors the optimizer held before the load. ``held_buffers``: the
    tensors view several buffers (a step held in memory), all given in one call."""
    from tierstack.checkpointing import state as ckpt_state

    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.Adam(params, lr=0.1)
    sum(p.sum() for p in params).backward()
    opt.step()  # creates the state the load will land on
    before = ckpt_state.optimizer_state_tensors(opt)
    old_ptrs = {k: t.data_ptr() for k, t in before.items()}
    saved = opt.state_dict()  # references to the live state tensors
    expected = {(i, k): t + 1 for i, st in saved["state"].items() for k, t in st.items()}
    nbytes = sum(t.numel() * t.element_size() for st in saved["state"].values() for t in st.values())
    source = torch.empty(nbytes, dtype=torch.uint8)  # the "file": every loaded tensor is a view of it
    buffers = []  # or one buffer per tensor
    offset, loaded = 0, {"state": {}, "param_groups": saved["param_groups"]}
    for i, st in saved["state"].items():
        loaded["state"][i] = {}
        for k, t in st.items():
            n = t.numel() * t.element_size()
            if held_buffers:
                buffers.append(torch.empty(n, dtype=torch.uint8))
            view = (buffers[-1] if held_buffers else source[offset:offset + n]).view(t.dtype).reshape(t.shape)
            view.copy_(expected[(i, k)])
            loaded["state"][i][k] = view
            offset += n
    opt.load_state_dict(loaded)
    spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in (buffers if held_buffers else [source])]
    inside = lambda t: any(lo <= t.data_ptr() < hi for lo, hi in spans)  # noqa: E731
    assert any(inside(t) for t in ckpt_state.optimizer_state_tensors(opt).values())  # torch kept the views
    assert ckpt_state.own_optimizer_state(opt, before, buffers if held_buffers else source) == nbytes
    after = ckpt_state.optimizer_state_tensors(opt)
    assert not any(inside(t) for t in after.values())
    assert {k: t.data_ptr() for k, t in after.items()} == old_ptrs  # back in the optimizer's own tensors
    for (i, k), t in expected.items():
        assert torch.equal(opt.state[params[i]][k], t), (i, k)


def test_retention_runs_off_the_training_thread_and_its_wait_is_bounded(caplog):
    """Retention (deleting old checkpoints) runs on the tier's retention thread, in order; waiting
    for it is bounded, and a deletion still running after the bound is left to the background."""
    from tierstack.checkpointing.staging import StagedTier

    tier = StagedTier("TEST", write_timeout_s=5.0)
    release, ran = threading.Event(), []
    tier._retain(lambda: (release.wait(10), ran.append((1, threading.current_thread().name))), "slow")
    tier._retain(lambda: ran.append((2, threading.current_thread().name)), "next")
    assert tier.retention_pending
    with caplog.at_level("WARNING"):
        assert tier.wait_retention(timeout_s=0.2) is False
    assert "still deleting old checkpoints" in caplog.text and ran == []
    release.set()
    assert tier.wait_retention() is True and not tier.retention_pending
    assert [n for n, _ in ran] == [1, 2] and all(t == "tierstack-TEST-retention" for _, t in ran)
    tier._retain(lambda: (_ for _ in ()).throw(OSError(5, "Input/output error")), "failing")
    with caplog.at_level("WARNING"):
        tier.close_retention()
    assert "TEST retention failing failed" in caplog.text
