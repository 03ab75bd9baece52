"""The file helpers every writer shares (``trl_ppomax.data.files``), through the trainer that writes with them: the
output_dir lock (a second run refused naming the holder, the lock released when training ends) and a file in the way of
save_model named. A full disk during a save is in ``test_ppo_checkpoint.py``."""

from __future__ import annotations

import os
import re

import pytest
from helpers import make_trainer, no_rollout

from trl_ppomax.data.files import LOCK_NAME, OutputDirInUse

HOLD_LOCK = """
import fcntl, os, socket, sys, time
lock = open(sys.argv[1], "a+")
fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
lock.seek(0); lock.truncate(); lock.write(f"{os.getpid()} on {socket.gethostname()}\\n"); lock.flush()
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_run_in_the_same_output_dir_is_refused_naming_the_holder(tmp_path, monkeypatch):
    """Two runs at once in one output_dir: the second crashed with a raw error. Now it is refused before its first
    rollout, naming the folder and the PID holding the lock; once that process is gone, the lock is free."""
    pytest.importorskip("fcntl")
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-c", HOLD_LOCK, str(out / LOCK_NAME)]
    holder = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        trainer = no_rollout(make_trainer(tmp_path), monkeypatch)
        with pytest.raises(OutputDirInUse) as caught:
            trainer.train()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    message = str(caught.value)
    for text in (repr(str(out)), f"process {holder.pid} on ", LOCK_NAME, "another output_dir", "no file needs"):
        assert text in message, text
    with pytest.raises(AssertionError, match="a rollout started"):  # the holder is gone: the same trainer starts
        trainer.train()
    assert (out / LOCK_NAME).read_text().startswith(f"{os.getpid()} on ")
    trainer.checkpointer.unlock_output_dir()


def test_the_output_dir_lock_is_released_when_training_ends(tmp_path):
    fcntl = pytest.importorskip("fcntl")
    make_trainer(tmp_path, total_episodes=16).train()
    with open(tmp_path / "out" / LOCK_NAME) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if the finished run still held it


def test_save_model_onto_a_file_is_refused_naming_it(tmp_path):
    trainer = make_trainer(tmp_path)
    file = tmp_path / "policy.safetensors"
    file.write_bytes(b"keep me")
    with pytest.raises(NotADirectoryError, match=rf"^Cannot save to {re.escape(str(file))}: it is an existing file"):
        trainer.save_model(str(file))
    with pytest.raises(NotADirectoryError, match=rf"it is under {re.escape(str(file))}, which is an existing file"):
        trainer.save_model(str(file / "policy"))
    assert file.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "policy.safetensors"]
