"""pdkv.credential: per-purpose MACs under the cluster secret, rotation, and `pdkv secret`."""

from __future__ import annotations

import subprocess
import sys

import pytest

import pdkv
from pdkv.credential import Credential, new_secret


def test_sign_verify_purposes_and_fields():
    c = Credential("s3cret")
    mac = c.sign("http", "POST", "/pd/role", b"{}")
    assert c.verify("http", mac, "POST", "/pd/role", b"{}")
    assert not c.verify("etcd", mac, "POST", "/pd/role", b"{}")      # another purpose
    assert not c.verify("http", mac, "POST", "/pd/role", b"{} ")     # another body
    assert not c.verify("http", mac, "POST", "/pd/rol", b"e{}")      # fields are length-prefixed
    assert not c.verify("http", mac.upper(), "POST", "/pd/role", b"{}")
    assert not c.verify("http", "", "POST", "/pd/role", b"{}")
    assert not c.verify("http", None, "POST")  # type: ignore[arg-type]
    assert not Credential("other").verify("http", mac, "POST", "/pd/role", b"{}")


def test_rotation_signs_with_the_first_and_accepts_any():
    old, new = Credential("old"), Credential("new", ["old"])
    assert new.verify("x", old.sign("x", "a"), "a")
    assert new.verify("x", new.sign("x", "a"), "a")
    assert not old.verify("x", new.sign("x", "a"), "a")
    assert Credential("new", ["old", "old", "new"]).accepted == (b"new", b"old")


@pytest.mark.parametrize("bad, match", [("", "empty"), ("x" * 1025, "longer than 1024"), (3, "str or bytes")])
def test_bad_secrets_are_named(bad, match):
    with pytest.raises(pdkv.InvalidArgument, match=match):
        Credential(bad)


def test_too_many_or_a_string_for_accepted():
    with pytest.raises(pdkv.InvalidArgument, match="at most 8"):
        Credential("a", [f"s{i}" for i in range(8)])
    with pytest.raises(pdkv.InvalidArgument, match="not one secret"):
        Credential("a", "old")


def test_from_env(monkeypatch):
    monkeypatch.delenv("PDKV_SECRET", raising=False)
    assert Credential.from_env() is None
    monkeypatch.setenv("PDKV_SECRET", "envsecret")
    monkeypatch.setenv("PDKV_ACCEPTED_SECRETS", "old1, old2,")
    c = Credential.from_env()
    assert c.accepted == (b"envsecret", b"old1", b"old2")
    assert "envsecret" not in repr(c) and "old1" not in repr(c)


def test_new_secret_and_the_cli():
    a, b = new_secret(), new_secret()
    assert a != b and len(bytes.fromhex(a)) == 16
    out = subprocess.run([sys.executable, "-m", "pdkv.cli", "secret"], capture_output=True, text=True, check=True)
    assert len(bytes.fromhex(out.stdout.strip())) == 16
