"""The API token and TLS helpers (stalwart/security/auth.py)."""
import os
import stat

import pytest

from stalwart.security import auth
def test_token_file_is_made_once_private_and_random(tmp_path):
    path = str(tmp_path / "state" / "token")
    first = auth.create_token_file(path)
    assert len(first) >= 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert auth.create_token_file(path) == first                 # a second start reads it back
    assert auth.create_token_file(str(tmp_path / "other")) != first
    assert not auth.loose_permissions(path)
    os.chmod(path, 0o644)
    assert auth.loose_permissions(path)


def test_bad_token_files_are_named(tmp_path):
    with pytest.raises(auth.AuthConfigError, match="cannot read the token file .*missing"):
        auth.read_token_file(str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(auth.AuthConfigError, match="is empty"):
        auth.read_token_file(str(tmp_path / "empty"))
    (tmp_path / "two").write_text("a b\n")
    with pytest.raises(auth.AuthConfigError, match="more than one word"):
        auth.read_token_file(str(tmp_path / "two"))


def test_controller_token_prefers_the_given_file(tmp_path):
    (tmp_path / "given").write_text("s3cret\n")
    assert auth.controller_token(str(tmp_path), str(tmp_path / "given")) == "s3cret"
    assert not (tmp_path / auth.TOKEN_FILE).exists()
    made = auth.controller_token(str(tmp_path))
    assert (tmp_path / auth.TOKEN_FILE).read_text().strip() == made


def test_client_token_order_file_then_environment_then_state_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    assert auth.client_token(None, str(tmp_path)) is None
    (tmp_path / auth.TOKEN_FILE).write_text("from-state\n")
    assert auth.client_token(None, str(tmp_path)) == "from-state"
    monkeypatch.setenv(auth.TOKEN_ENV, "from-env")
    assert auth.client_token(None, str(tmp_path)) == "from-env"
    (tmp_path / "f").write_text("from-file")
    assert auth.client_token(str(tmp_path / "f"), str(tmp_path)) == "from-file"


@pytest.mark.parametrize("header, ok, why", [
    (None, False, "no token"),
    ("", False, "no token"),
    ("Basic abc", False, "not a bearer token"),
    ("Bearer ", False, "not a bearer token"),
    ("Bearer wrong", False, "wrong token"),
    ("Bearer right", True, ""),
    ("bearer right", True, ""),
])
def test_bearer_header(header, ok, why):
    assert auth.bearer_ok(header, "right") == (ok, why)


def test_only_liveness_and_the_page_shell_are_public():
    assert auth.is_public("/") and auth.is_public("/api/health") and auth.is_public("/static/app.js")
    for path in ("/api/jobs", "/api/jobs/1", "/api/machines", "/metrics", "/api/agents/m0/register",
                 "/api/health/x", "/staticx"):
        assert not auth.is_public(path), path


def test_unreadable_tls_files_are_named(tmp_path):
    with pytest.raises(auth.AuthConfigError, match="cannot load the TLS certificate"):
        auth.server_tls(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"))
    with pytest.raises(auth.AuthConfigError, match="cannot load the CA file"):
        auth.client_tls(str(tmp_path / "ca.pem"))
