"""Code snapshots take code only: never a state dir (sockets, a database), a virtualenv, caches or
special files, and they say what they skipped (a second job from the same directory)."""
import os
import socket

import pytest

from stalwart.controller.code.tree import mark_state_dir, remove_tree, snapshot, versionable, walk


@pytest.fixture
def code(tmp_path):
    root = tmp_path / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('train')\n")
    (root / "pkg" / "model.py").write_text("X = 1\n")
    yield root
    for d in (tmp_path / "state", tmp_path / "state2"):
        remove_tree(str(d))


def test_another_jobs_state_dir_with_a_live_socket_is_skipped(code, tmp_path):
    other = code / "sd40"                      # `stalwart run --state-dir sd40` made it here
    mark_state_dir(str(other))
    (other / "machines" / "m0").mkdir(parents=True)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(other / "machines" / "m0" / "agent.sock"))
    try:
        h, path, skipped = snapshot(str(code), str(tmp_path / "state"))
    finally:
        sock.close()
    assert sorted(os.listdir(path)) == ["pkg", "train.py"]
    assert skipped == ["sd40/ (a stalwart state dir)"]


def test_virtualenvs_caches_and_special_files_are_left_out(code, tmp_path):
    (code / ".venv" / "lib").mkdir(parents=True)
    (code / ".venv" / "pyvenv.cfg").write_text("home = /usr\n")
    (code / ".venv" / "lib" / "big.so").write_bytes(b"x" * 1000)
    (code / ".pytest_cache").mkdir()
    (code / ".pytest_cache" / "v").write_text("x")
    os.mkfifo(code / "pipe")
    tree = walk(str(code))
    assert [rel for rel, _ in tree.entries] == ["pkg/model.py", "train.py"]
    assert sorted(tree.skipped) == [".venv/ (a Python virtualenv)", "pipe (neither a file nor a symlink)"]
    assert versionable(str(code), str(tmp_path / "state")) is None


def test_an_old_state_dir_without_marker_is_recognised_by_its_database(code, tmp_path):
    (code / "old").mkdir()
    (code / "old" / "stalwart.db").write_bytes(b"")
    _, path, skipped = snapshot(str(code), str(tmp_path / "state2"))
    assert not os.path.exists(os.path.join(path, "old")) and skipped == ["old/ (a stalwart state dir)"]


def test_an_unreadable_file_is_a_one_line_error(code, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads everything")
    f = code / "secret.py"
    f.write_text("x")
    f.chmod(0)
    with pytest.raises(ValueError, match="cannot snapshot secret.py"):
        snapshot(str(code), str(tmp_path / "state"))
