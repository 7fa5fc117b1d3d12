"""LOCAL replication sends a file in bounded rounds: two real gloo ranks exchange files of different
sizes through nvidia-resiliency-ext's clique strategy, and no round puts more than CHUNK_BYTES of a
file where NCCL would need it on the device (the sender's staged chunk, each received tensor); the
resume retrieval of a lost file from a replica runs in the same bounded rounds."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CHUNK = 1000
SIZES = {0: 4500, 1: 2100}  # 5 and 3 chunks: rank 1 sends empty chunks in the last two rounds


def _file(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randint(0, 256, (SIZES[rank],), dtype=torch.uint8, generator=g)


def _worker(rank: int, init: str, out: str) -> None:
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

    from tierstack.checkpointing import replication

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    staged, received = [], []
    replication.CHUNK_BYTES = CHUNK
    real_to_device, real_replicate = replication._to_device, CliqueReplicationStrategy.replicate

    def to_device(t):  # the one place a file's bytes are put on the device (NCCL)
        staged.append(int(t.numel()))
        return real_to_device(t)

    def replicate(self, local_ckpt, id_):  # NVRx allocates what it receives on the sender's device type
        theirs, ids = real_replicate(self, local_ckpt, id_)
        received.append(max(int(t.numel()) for r in theirs for t in r.tensors))
        return theirs, ids

    replication._to_device = to_device
    CliqueReplicationStrategy.replicate = replicate
    rep = replication.Replicator(2, 1, rank, 2, timeout_s=60)
    (theirs,) = rep.replicate(7, {"files": {f"f{rank}": {}}}, _file(rank))
    torch.save({"owner": theirs.owner, "manifest": theirs.manifest, "data": theirs.data, "staged": staged,
                "received": received}, os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


def test_replication_rounds_keep_device_bytes_below_the_chunk(tmp_path):
    init = f"file://{tmp_path / 'store'}"
    mp.start_processes(_worker, args=(init, str(tmp_path)), nprocs=2, start_method="spawn")
    for rank, other in ((0, 1), (1, 0)):
        got = torch.load(tmp_path / f"{rank}.pt", weights_only=False)
        assert got["owner"] == other and got["manifest"] == {"files": {f"f{other}": {}}}
        assert torch.equal(got["data"], _file(other))  # reassembled byte for byte
        assert len(got["staged"]) == 5 and len(got["received"]) == 5  # one exchange per round, every rank
        assert max(got["staged"]) <= CHUNK and max(got["received"]) <= CHUNK
    assert torch.load(tmp_path / "1.pt", weights_only=False)["staged"][-2:] == [0, 0]


def _retrieve_worker(rank: int, init: str, out: str) -> None:
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

    from tierstack.checkpointing import replication
    from tierstack.runtime import cpu_compat

    if not torch.cuda.is_available():  # NVRx receives into empty_like(..., device="cuda"): the host, as in a CPU run
        cpu_compat.activate()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    staged, received = [], []
    replication.CHUNK_BYTES = CHUNK
    real_to_device, real_execute = replication._to_device, CliqueReplicationStrategy.retrieve_execute

    def to_device(t):
        staged.append(int(t.numel()))
        return real_to_device(t)

    def execute(self, plan, my_data):  # NVRx allocates what it receives on the sender's device type
        got = real_execute(self, plan, my_data)
        received.extend(int(t.numel()) for r in got.values() for t in r.tensors)
        return got

    replication._to_device = to_device
    CliqueReplicationStrategy.retrieve_execute = execute
    rep = replication.Replicator(2, 1, rank, 2, timeout_s=60)
    # rank 1's node was replaced: its file of step 7 is gone; rank 0 holds it as a replica
    available = {0: ["7:0", "7:1"], 1: []}
    wanted = ["7:1"] if rank == 1 else []

    def load(id_):
        owner = replication.parse_replica_id(id_)[1]
        return replication.FileReplica(owner, 7, {"files": {f"f{owner}": {}}}, _file(owner))

    got = rep.retrieve(available, wanted, load)
    torch.save({"got": {k: (r.owner, r.manifest, r.data, sender) for k, (r, sender) in got.items()},
                "staged": staged, "received": received}, os.path.join(out, f"r{rank}.pt"))
    dist.destroy_process_group()


def test_resume_retrieval_moves_a_lost_file_in_bounded_rounds(tmp_path):
    init = f"file://{tmp_path / 'store'}"
    mp.start_processes(_retrieve_worker, args=(init, str(tmp_path)), nprocs=2, start_method="spawn")
    sender, receiver = (torch.load(tmp_path / f"r{r}.pt", weights_only=False) for r in (0, 1))
    owner, manifest, data, from_rank = receiver["got"]["7:1"]
    assert (owner, manifest, from_rank) == (1, {"files": {"f1": {}}}, 0)
    assert torch.equal(data, _file(1))  # reassembled byte for byte
    assert sender["got"] == {}
    assert len(sender["staged"]) == 3 == len(receiver["received"])  # 2100 bytes: 3 rounds of <= 1000
    assert max(sender["staged"]) <= CHUNK and max(receiver["received"]) <= CHUNK
