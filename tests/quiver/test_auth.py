"""Who may write and read (issue 43 item 4): a Bearer token compared in constant time, 401 with
nothing logged or applied, ``--auth predict``, and no writable graph open beyond loopback."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from hetero_cases import FACTORY, mag_sage

from quiver.hetero import HeteroServer
from quiver.hetero.updates import LOG_FILE
from quiver.serving import Engine, ServeConfig
from quiver.serving.app import create_app
from quiver.serving.auth import ENV_VAR, authorised, check_open_writes, is_loopback, load_token
from quiver.serving.client import Client, ServerError
from quiver.serving.http import HTTPThread

TOKEN = "s3cret-token"
EDGE = {"op": "add_edges", "edge_type": "paper__cites__paper", "src": [1], "dst": [2]}


def test_authorised_needs_the_exact_bearer_token():
    assert authorised(f"Bearer {TOKEN}", TOKEN) and authorised(f"bearer {TOKEN}", TOKEN)
    for header in (None, "", TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer ", "Bearer s3"):
        assert not authorised(header, TOKEN)
    assert authorised(None, None)  # no token configured: nothing to check


def test_the_token_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert load_token() is None
    (tmp_path / "t").write_text(f"{TOKEN}\n")
    assert load_token(tmp_path / "t") == TOKEN
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_token(tmp_path / "empty")
    with pytest.raises(ValueError, match="--auth-token-file"):
        load_token(tmp_path / "missing")
    monkeypatch.setenv(ENV_VAR, TOKEN)
    assert load_token() == TOKEN


def test_open_writes_beyond_loopback_are_refused_in_one_line():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    with pytest.raises(ValueError, match="--auth-token-file PATH .* or serve read-only"):
        check_open_writes("0.0.0.0", True, None)
    check_open_writes("0.0.0.0", True, TOKEN)
    check_open_writes("0.0.0.0", False, None)
    check_open_writes("127.0.0.1", True, None)


@pytest.fixture(scope="module")
def hetero(tmp_path_factory):
    """A tiny hetero directory and checkpoint; one server per auth mode is started by tests."""
    _, d, _, _, ckpt = mag_sage(tmp_path_factory.mktemp("auth"))
    return d, ckpt


def _log(d) -> bytes:
    path = d / LOG_FILE
    return path.read_bytes() if path.exists() else b""


@pytest.mark.parametrize("auth_predict", [False, True])
def test_updates_need_the_token_and_a_refused_one_changes_nothing(hetero, auth_predict):
    d, ckpt = hetero
    cfg = ServeConfig(auth_token=TOKEN, auth_predict=auth_predict)
    assert TOKEN not in repr(cfg)
    with HeteroServer.from_dataset(d, ckpt, cfg, model=FACTORY, seed=0) as srv:
        srv.start(port=0)
        before, seq = _log(d), srv.live.seq
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                r = c.post("/v1/update", json=EDGE, headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
                assert "Authorization: Bearer" in r.json()["error"]
            assert _log(d) == before and srv.live.seq == seq
            ok = {"Authorization": f"Bearer {TOKEN}"}
            assert c.post("/v1/update", json=EDGE, headers=ok).status_code == 200
            assert srv.live.seq == seq + 1
            body = {"node_type": "paper", "nodes": [0, 1]}
            r = c.post("/v1/predict", json=body)
            assert r.status_code == (401 if auth_predict else 200)
            assert c.post("/v1/predict", json=body, headers=ok).status_code == 200
            assert c.get("/healthz").status_code == 200  # liveness stays open


def test_auth_predict_on_a_homogeneous_server_and_the_client_token(world):
    cfg = ServeConfig(shed_late=False, auth_token=TOKEN, auth_predict=True)
    eng = Engine(world.sampler, world.x, world.model, world.n, cfg)
    eng.start()
    http = HTTPThread(create_app(eng)).start()
    try:
        with Client(http.url, token="wrong") as c, pytest.raises(ServerError) as e:
            c.predict([1, 2])
        assert e.value.status == 401
        r = httpx.post(f"{http.url}/v1/predict", content=b"{not json")  # refused unread
        assert r.status_code == 401
        with Client(http.url, token=TOKEN) as c:
            assert c.predict([5, 17])["values"] == world.offline([5, 17]).argmax(1).tolist()
    finally:
        http.stop()
        eng.stop()


def test_quiver_serve_refuses_a_writable_graph_on_all_interfaces_without_a_token(hetero):
    d, ckpt = hetero
    env_cmd = [sys.executable, "-m", "quiver.cli", "serve", str(d), "--checkpoint", str(ckpt)]
    env_cmd += ["--model", FACTORY, "--host", "0.0.0.0", "--port", "8798"]
    env = {k: v for k, v in __import__("os").environ.items() if k != ENV_VAR}
    r = subprocess.run(env_cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--host 0.0.0.0 would let anyone" in r.stderr and "--read-only" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
