"""Checkpoint memory paths: owners and orphans (`stalwart cleanup --orphans`)."""
from __future__ import annotations

import os

from stalwart.agent.paths import ckpt_root, claim, orphans
from stalwart.cli import main


def test_memory_whose_machine_directory_is_gone_is_an_orphan(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    kept, gone = tmp_path / "m0", tmp_path / "m1"
    kept.mkdir()
    gone.mkdir()
    root_kept, root_gone = claim(str(kept), str(shm)), claim(str(gone), str(shm))
    assert root_kept == ckpt_root(str(kept), str(shm)) and os.path.isdir(root_gone)
    (shm / "stalwart-unknown").mkdir()              # no owner noted: not ours to judge
    assert orphans(str(shm)) == []
    gone.rmdir()
    assert orphans(str(shm)) == [root_gone]


def test_cleanup_frees_orphans_only_when_asked(tmp_path, capsys, monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    gone = tmp_path / "m1"
    gone.mkdir()
    root = claim(str(gone), str(shm))
    gone.rmdir()
    monkeypatch.setattr("stalwart.agent.paths.SHM", str(shm))
    monkeypatch.setattr("stalwart.agent.paths.orphans.__defaults__", (str(shm),))
    assert main(["cleanup", "--state-dir", str(tmp_path / "state")]) == 0
    assert os.path.isdir(root)
    assert main(["cleanup", "--state-dir", str(tmp_path / "state"), "--orphans"]) == 0
    assert not os.path.exists(root)
    assert "freed the checkpoint memory of 1 machine(s)" in capsys.readouterr().out
