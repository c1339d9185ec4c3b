"""Unit tests are pure: one that starts a process (subprocess, fork, multiprocessing) fails here
and belongs in tests/integration."""
import multiprocessing.process
import os
import subprocess

import pytest


def _refuse(*_a, **_kw):
    raise AssertionError("a unit test started a process: move it to tests/integration")


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse)
    monkeypatch.setattr(os, "fork", _refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse)
