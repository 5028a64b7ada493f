"""course_lib.checkpoint's commit: a save overwriting a checkpoint, with one rank SIGKILLed as its write starts or
in the middle of it, leaves the folder loading whole as the earlier step; `latest` never offers a save that was
not committed, and reads one whose commit was cut between its two renames."""

import json
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_files

from course_lib import checkpoint, checkpoint_commit
from course_lib.model import build, preset
from course_lib.runs.checkpoint import LAYOUTS, Trainer
from course_lib.runtime.launch import RankError, launch
from course_lib.train import reference_run

pytestmark = pytest.mark.ranks


def overwrite_while_a_rank_dies(rank, world_size, *, root: str, when: str):
    """Save after 2 steps, train 2 more, save again to the same folder; rank 1 SIGKILLs itself as its second
    write starts ("start") or after its first record is on disk ("middle")."""
    trainer = Trainer(rank, world_size, LAYOUTS["dp2 zero1"])
    path = os.path.join(root, "ckpt")
    for _ in range(2):
        trainer.step()
    trainer.save(path)
    for _ in range(2):
        trainer.step()
    if rank == 1:
        original = dcp_files._write_item

        def dying(*args, **kwargs):
            if when == "start":
                os.kill(os.getpid(), signal.SIGKILL)
            result = original(*args, **kwargs)
            args[1].flush()                              # the first record really is in the file
            os.kill(os.getpid(), signal.SIGKILL)
            return result
        dcp_files._write_item = dying
    trainer.save(path)


@pytest.mark.parametrize("when", ["start", "middle"])
def test_an_overwrite_cut_by_a_killed_rank_leaves_the_earlier_step_whole(tmp_path, when):
    with pytest.raises(RankError, match="rank 1"):
        launch(overwrite_while_a_rank_dies, 2, root=str(tmp_path), when=when, timeout=120)
    path = str(tmp_path / "ckpt")
    assert checkpoint.latest(str(tmp_path)) == path
    model = build(preset("tiny"), dtype=torch.float64)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    train = checkpoint.load_plain(model, optimizer, path, checkpoint.train_state(0, seed=0, batch_size=8))
    assert train["step"] == 2
    _, reference = reference_run(steps=2, batch_size=8, lr=1e-2, seq_len=16, dtype=torch.float64)
    gap = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    assert gap < 1e-12, gap                              # every weight of step 2: no rank's shard of step 4


def test_latest_offers_only_committed_checkpoints(tmp_path):
    """step_00003 committed; step_00006.partial cut (no .metadata, or with it: never renamed); step_00009's commit
    cut between its renames: only step_00009.replaced is there, whole, and it is step_00009."""
    def folder(name, metadata=True):
        (tmp_path / name).mkdir()
        if metadata:
            (tmp_path / name / ".metadata").write_bytes(b"")
    folder("step_00003")
    folder("step_00006.partial")
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step_00003")
    folder("step_00009.replaced")
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step_00009")
    assert checkpoint.committed(str(tmp_path / "step_00009")) == str(tmp_path / "step_00009.replaced")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint at .*step_00006"):
        checkpoint.committed(str(tmp_path / "step_00006"))


def save_a_step(rank, world_size, *, root: str):
    trainer = Trainer(rank, world_size, LAYOUTS["dp2 zero1"])
    trainer.step()
    trainer.save(os.path.join(root, "ckpt"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    launch(save_a_step, 2, root=str(root))
    return root / "ckpt"


@pytest.mark.parametrize("changes, named", [(dict(num_layers=2), "num_layers=4 (this model: 2)"),
                                            (dict(num_heads=4, num_kv_heads=2), "num_heads=8 (this model: 4)")])
def test_a_checkpoint_of_another_model_is_refused_before_any_weight_is_read(saved, changes, named):
    """Fewer layers (the checkpoint's extra keys would be ignored), or other heads with the same weights' shapes:
    refused, naming the fields; the model keeps its own weights."""
    model = build(preset("tiny", **changes), dtype=torch.float64)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    with pytest.raises(ValueError, match="holds another model: .*" + re.escape(named)):
        checkpoint.load_plain(model, optimizer, str(saved), checkpoint.train_state(0, seed=0, batch_size=8))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_flipped_byte_is_refused_naming_its_file(saved, tmp_path):
    import shutil
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    shard = copy / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    model = build(preset("tiny"), dtype=torch.float64)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    with pytest.raises(ValueError, match=r"__1_0.distcp is corrupted"):
        checkpoint.load_plain(model, optimizer, str(copy), checkpoint.train_state(0, seed=0, batch_size=8))
    train = checkpoint.load_plain(model, optimizer, str(saved), checkpoint.train_state(0, seed=0, batch_size=8))
    assert train["step"] == 1                                        # the untouched one loads


def save_asynchronously_and_return(rank, world_size, *, root: str):
    trainer = Trainer(rank, world_size, LAYOUTS["dp2 zero1"])
    trainer.step()
    trainer.save(os.path.join(root, "ckpt"), asynchronous=True)     # never waited for


def test_an_asynchronous_save_not_waited_for_is_finished_and_said(tmp_path, capfd):
    """The function returns while its save is still writing; the world ends next. The rank waits for it, says
    so, and the checkpoint is committed: step 1, whole."""
    launch(save_asynchronously_and_return, 2, root=str(tmp_path), timeout=120)
    assert "asynchronous save of" in capfd.readouterr().err
    model = build(preset("tiny"), dtype=torch.float64)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    train = checkpoint.load_plain(model, optimizer, str(tmp_path / "ckpt"), checkpoint.train_state(0, seed=0,
                                                                                                    batch_size=8))
    assert train["step"] == 1


def save_asynchronously(rank, world_size, *, root: str, fail: bool):
    trainer = Trainer(rank, world_size, LAYOUTS["dp2 zero1"])
    trainer.step()
    pending = trainer.save(os.path.join(root, "ckpt"), asynchronous=True)
    if fail:
        raise ValueError("the function fails while its save writes")
    pending.result()


def process_groups(rank, world_size):
    import torch.distributed.distributed_c10d as c10d
    return len(c10d._world.pg_map)


def test_a_failed_functions_asynchronous_save_lets_go_of_its_group_once_done(tmp_path):
    """A function that fails is not waited for (its peers may be gone), nor is its save; the save's own gloo group
    is closed once the save is done, by the next function that runs on the rank: the failed function leaves the
    groups a waited one leaves (its trainer's), no more."""
    from course_lib.runtime.world import World

    with World(2) as world:
        before = world.run(process_groups)
        world.run(save_asynchronously, root=str(tmp_path / "waited"), fail=False)
        waited = world.run(process_groups)
        with pytest.raises(RankError, match="the function fails while its save writes"):
            world.run(save_asynchronously, root=str(tmp_path / "failed"), fail=True)
        trainers = [mine - first for mine, first in zip(waited, before)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:      # each function the rank runs closes the groups of saves now done
            left = [after - mine for after, mine in zip(world.run(process_groups), waited)]
            if left == trainers:
                break
            time.sleep(0.2)
        assert left == trainers
        assert (tmp_path / "failed" / "ckpt").exists()                               # and rank 0 committed it


def save_while_a_peer_dies(rank, world_size, *, root: str):
    trainer = Trainer(rank, world_size, LAYOUTS["dp2 zero1"])
    trainer.step()
    trainer.save(os.path.join(root, "ckpt"), asynchronous=True)
    if rank == 1:
        time.sleep(0.5)
        os._exit(3)                                  # dies while its save writes
    raise ValueError("rank 0 fails too")


def test_an_abandoned_save_whose_group_the_rebuilt_world_destroyed_closes_quietly(tmp_path):
    """The survivors' rebuild destroys every process group, the abandoned save's too: closing it then must not
    kill rank 0 (it did, and the world restarted every rank, their variables lost)."""
    from course_lib.runtime.world import World

    with World(2) as world:
        first = world.run(lambda rank, world_size: os.getpid())
        with pytest.raises(RankError, match="rank 1: the process died .exit code 3."):
            world.run(save_while_a_peer_dies, root=str(tmp_path))
        after = world.run(lambda rank, world_size: os.getpid())
        assert after[0] == first[0] and after[1] != first[1] and world.generation == 1


def test_a_checkpoint_that_cannot_be_read_is_one_line_naming_it(saved, tmp_path):
    """A shard cut short (its checksum rewritten to match, so only DCP's reader can tell): one line naming the
    folder, the rank and the cause, not DCP's ~70 lines of every rank's traceback."""
    import json
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    sums = json.loads((folder / "checksums.json").read_text())
    sums[shard.name] = checkpoint_commit._sha256(str(shard))
    (folder / "checksums.json").write_text(json.dumps(sums))
    model = build(preset("tiny"), dtype=torch.float64)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    with pytest.raises(RuntimeError, match=r"ckpt: (loading|reading the step and config) failed on rank 0: ") as error:
        checkpoint.load_plain(model, optimizer, str(folder), checkpoint.train_state(0, seed=0, batch_size=8))
    assert "\n" not in str(error.value)


def save_to(rank, world_size, *, path: str):
    Trainer(rank, world_size, LAYOUTS["dp2 zero1"]).save(path)


@pytest.mark.parametrize("suffix", ["", checkpoint_commit.PARTIAL, checkpoint_commit.REPLACED])
def test_a_save_refuses_a_folder_the_course_did_not_make_and_leaves_it(tmp_path, suffix):
    """A learner's folder where a save would replace or remove one (the path itself, its .partial, its .replaced)
    is refused by name on every rank, before anything is written, and stays as it was."""
    path = tmp_path / "results"
    mine = tmp_path / f"results{suffix}"
    mine.mkdir()
    (mine / "thesis.txt").write_text("three years")
    with pytest.raises(RankError, match="did not make it"):
        launch(save_to, 2, path=str(path), timeout=60)
    assert sorted(os.listdir(mine)) == ["thesis.txt"] and (mine / "thesis.txt").read_text() == "three years"


def test_a_commit_tried_again_lists_its_files_not_its_own_checksums(tmp_path):
    """A commit that failed after writing CHECKSUMS and is tried again (PendingSave.result) must not list the stale
    CHECKSUMS inside the new one: the checkpoint would then refuse itself as corrupted."""
    staging, path = tmp_path / "ckpt.partial", tmp_path / "ckpt"
    staging.mkdir()
    (staging / ".metadata").write_bytes(b"metadata")
    (staging / "__0_0.distcp").write_bytes(b"weights")
    (staging / checkpoint_commit.CHECKSUMS).write_text('{".metadata": "stale"}')    # the first try's
    checkpoint_commit.commit(str(staging), str(path))
    checkpoint_commit.verify_checksums(str(path))
    listed = json.loads((path / checkpoint_commit.CHECKSUMS).read_text())
    assert sorted(listed) == [".metadata", "__0_0.distcp"]


def train_while_saving_slowly(rank, world_size, *, root: str):
    """Rank 1's disk is slow: its asynchronous save still writes (DCP's collectives in a thread) while both ranks
    train on, all-reducing on the default group, and then save again."""
    import torch.distributed.checkpoint.filesystem as files
    if rank == 1:
        write = files._write_item
        files._write_item = lambda *args, **kwargs: (time.sleep(0.2), write(*args, **kwargs))[1]
    trainer = Trainer(rank, world_size, LAYOUTS["dp2 zero1"])
    trainer.step()
    trainer.save(os.path.join(root, "first"), asynchronous=True)
    for _ in range(2):
        trainer.step()
    trainer.save(os.path.join(root, "second"), asynchronous=True).result()   # waits for the first one too
    return trainer.next_step


def test_training_goes_on_beside_an_asynchronous_save_without_mixing_their_collectives(tmp_path):
    assert launch(train_while_saving_slowly, 2, root=str(tmp_path), timeout=120) == [3, 3]
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "second")
    model = build(preset("tiny"), dtype=torch.float64)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    first = checkpoint.load_plain(model, optimizer, str(tmp_path / "first"), checkpoint.train_state(0, seed=0,
                                                                                                   batch_size=8))
    assert first["step"] == 1


def refused_load_keeps(rank, world_size, *, path: str):
    trainer = Trainer(rank, world_size, LAYOUTS["dp2 zero1"], seed=1)
    trainer.step()
    before = {name: piece.clone() for name, piece in trainer.pieces().items()}
    try:
        trainer.load(path)
    except ValueError as error:
        assert "is not this run's" in str(error)
    else:
        raise AssertionError("a checkpoint of another data stream was loaded")
    after = trainer.pieces()
    return all(torch.equal(before[name], after[name]) for name in before) and trainer.next_step == 1


def test_a_refused_load_leaves_the_run_as_it_was(tmp_path):
    path = str(tmp_path / "ckpt")
    launch(save_to, 2, path=path, timeout=60)
    assert launch(refused_load_keeps, 2, path=path, timeout=60) == [True, True]


def load_right_after_an_asynchronous_save(rank, world_size, *, root: str):
    trainer = Trainer(rank, world_size, LAYOUTS["dp2 zero1"])
    trainer.step()
    path = os.path.join(root, "ckpt")
    trainer.save(path, asynchronous=True)            # not waited for: load waits, and for rank 0's commit
    trainer.save(path, asynchronous=True)            # a second save of the same path waits for the first too
    return trainer.load(path)["data"]["next_step"]


def test_a_load_or_a_save_right_after_an_asynchronous_save_finds_it_committed(tmp_path):
    assert launch(load_right_after_an_asynchronous_save, 2, root=str(tmp_path), timeout=120) == [1, 1]
