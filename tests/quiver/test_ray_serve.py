"""``quiver serve --replicas``: engine replicas on a local Ray Serve cluster (loopback only).

One Ray cluster (2 CPUs, no dashboard, logs in a temporary directory) with a 2-replica
deployment is shared by the module's tests; the tests needing it skip when Ray is absent.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from quiver.cli import main as quiver_main

NODES = [3, 17, 0, 42, 17, 99]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from quiver.datasets import synthetic

    d = tmp_path_factory.mktemp("tiny")
    synthetic("tiny", seed=0, out=d)
    ckpt = d / "ckpt.pt"
    argv = ["train-model", str(d), "--out", str(ckpt), "--epochs", "1", "--fanouts", "5,3"]
    assert quiver_main(argv + ["--batch-size", "32", "--hidden", "16"]) == 0
    return d, ckpt


# all-neighbour fanouts: every replica samples the same subgraph whatever it served before
SERVE_ARGS = ["--fanouts=-1,-1", "--seed", "0", "--slo-ms", "2000", "--sampler-workers", "1"]
# the body bounds the proxy must apply, as the single-process server does
READ_TIMEOUT_S = 2.0
MAX_BODY_BYTES = 4096
SERVE_ARGS += ["--read-timeout", str(READ_TIMEOUT_S), "--max-body-bytes", str(MAX_BODY_BYTES)]


@pytest.fixture(scope="module")
def cluster(trained, tmp_path_factory):
    """``quiver serve --replicas 2`` as its own process (a local Ray cluster inside it): its URL.

    Stopped with SIGTERM at the end, which must delete the deployment and exit 0."""
    pytest.importorskip("ray.serve", reason="Ray Serve not installed (pip install .[scale])")
    import httpx

    from quiver.serving.http import free_port

    d, ckpt = trained
    # short: Ray's unix socket paths live under it and must stay under 108 characters
    tmp = tempfile.mkdtemp(prefix="qray", dir="/tmp")
    log = tmp_path_factory.mktemp("ray_serve") / "serve.log"
    port = free_port()
    argv = [sys.executable, "-m", "quiver.cli", "serve", str(d), "--checkpoint", str(ckpt)]
    argv += ["--port", str(port), *SERVE_ARGS, "--replicas", "2", "--replica-cpus", "0.5"]
    env = {**os.environ, "RAY_TMPDIR": tmp, "RAY_USAGE_STATS_ENABLED": "0"}
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        # Ray's proxy listens before the deployment is up (and answers 404/503 until then)
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"serve exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not ready: {log.read_text()[-3000:]}"
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        print(f"quiver serve --replicas 2 up in {time.monotonic() - t0:.1f} s")
        yield url
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert "quiver serve: stopped" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


def _replica_pids(client, want: int = 2, timeout: float = 30.0, exclude=()) -> dict:
    """``{replica id: pid}`` seen through ``/healthz`` until ``want`` distinct live ones."""
    seen: dict = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = client.get("/healthz")
        except Exception:  # noqa: BLE001 (a replica restarting)
            time.sleep(0.1)
            continue
        if r.status_code == 200:
            body = r.json()
            if body["pid"] not in exclude:
                seen[body["replica"]] = body["pid"]
        if len(seen) >= want:
            return seen
        time.sleep(0.02)
    raise AssertionError(f"only {len(seen)} replicas seen in {timeout} s: {seen}")


@pytest.mark.slow
def test_replicas_answer_the_single_process_logits(cluster, trained):
    import httpx

    from quiver.serving import ServeConfig
    from quiver.serving.server import Server

    d, ckpt = trained
    cfg = ServeConfig(slo_ms=2000, num_sampler_workers=1)
    # replicas do not fold under auto (they share the mapped features): nor does the reference
    with Server.from_dataset(d, ckpt, cfg, fanouts=[-1, -1], seed=0, fold="off") as server:
        want = server.predict(NODES, output="logits").values
    with httpx.Client(base_url=cluster, timeout=10) as client:
        pids = _replica_pids(client)
        assert len(set(pids.values())) == 2
        for _ in range(16):  # the proxy spreads them over both replicas
            r = client.post("/v1/predict", json={"nodes": NODES, "output": "logits"})
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(np.array(r.json()["values"]), want, rtol=1e-5, atol=1e-5)
        # the same validation as one process: JSON errors, per replica
        r = client.post("/v1/predict", json={"nodes": [10**9]})
        assert r.status_code == 422 and "error" in r.json()
        r = client.post("/v1/predict", json={"nodes": [1], "outptu": "class"})
        assert r.status_code == 422 and "unknown field" in r.json()["error"]
        # replicas serve read-only: an update is refused, naming why
        r = client.post("/v1/update", json={"op": "add_edges", "src": [1], "dst": [2]})
        assert r.status_code == 403 and "read-only" in r.json()["error"]
        # /metrics: every replica's samples, each labelled with its replica
        text = client.get("/metrics").text
        for replica in pids:
            assert f'quiver_requests_total{{replica="{replica}"' in text or (
                f'replica="{replica}"' in text
            )
        assert text.count("# TYPE quiver_batches_total") <= 1


@pytest.mark.slow
def test_killed_replica_is_restarted_and_no_request_hangs(cluster):
    import httpx

    with httpx.Client(base_url=cluster, timeout=10) as client:
        pids = _replica_pids(client)
    victim = next(iter(pids.values()))
    num_requests, timeout_s = 160, 15.0

    def one(i: int):
        nodes = [i % 200, (7 * i) % 200]
        try:
            with httpx.Client(base_url=cluster, timeout=timeout_s) as c:
                r = c.post("/v1/predict", json={"nodes": nodes})
            return i, nodes, r.status_code, (r.json() if r.status_code == 200 else None)
        except httpx.TimeoutException:
            return i, nodes, "timeout", None
        except httpx.HTTPError as e:  # connection reset by the dying replica: an error, not a hang
            return i, nodes, type(e).__name__, None

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(one, i) for i in range(num_requests)]
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        results = [f.result(timeout=3 * timeout_s) for f in futs]
    elapsed = time.monotonic() - t0
    statuses = [s for _, _, s, _ in results]
    assert "timeout" not in statuses, statuses
    assert sorted(i for i, *_ in results) == list(range(num_requests))  # one answer each
    for _, nodes, status, body in results:
        if status == 200:
            assert body["nodes"] == nodes  # the answer to this request, not another's
    ok = statuses.count(200)
    print(
        f"{ok}/{num_requests} answered 200 in {elapsed:.1f} s; others: "
        f"{sorted({s for s in statuses if s != 200}, key=str)}"
    )
    assert ok > num_requests // 2
    with httpx.Client(base_url=cluster, timeout=10) as client:
        after = _replica_pids(client, timeout=60, exclude={victim})
        assert victim not in after.values() and len(after) == 2
        assert client.post("/v1/predict", json={"nodes": [1, 2]}).status_code == 200


@pytest.mark.slow
def test_replicas_map_the_dataset_shared(cluster):
    """Each replica's dataset pages are file-backed (shared page cache), reported per replica."""
    import httpx

    with httpx.Client(base_url=cluster, timeout=10) as client:
        pids = _replica_pids(client)
    for pid in pids.values():
        status = open(f"/proc/{pid}/status").read()
        rss = {k: v for k, v in (ln.split(":", 1) for ln in status.splitlines()) if "Rss" in k}
        print(pid, {k: v.strip() for k, v in rss.items()})
        maps = open(f"/proc/{pid}/maps").read()
        assert "features.npy" in maps  # memory-mapped, not read into private memory


def _raw_reply(url: str, data: bytes, timeout: float = 30.0) -> tuple[bytes, float]:
    """Send ``data`` on a new connection, send nothing more: the reply and its delay."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    s = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
    try:
        s.sendall(data)
        t0 = time.monotonic()
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
            head, _, body = reply.partition(b"\r\n\r\n")
            if body and b"content-length:" in head.lower():
                n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(body) >= n:
                    break
        return reply, time.monotonic() - t0
    finally:
        s.close()


def _predict_head(length: int) -> bytes:
    return (
        b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % length
    )


@pytest.mark.slow
def test_replicas_answer_a_short_body_408_within_the_read_timeout(cluster):
    """A body shorter than its content-length: 408 at --read-timeout (Ray's proxy alone has no
    read timeout and would wait for the rest)."""
    reply, took = _raw_reply(cluster, _predict_head(100) + b'{"nodes": [1')
    assert reply.startswith(b"HTTP/1.1 408"), reply[:300]
    assert b"request body not received within 2 s" in reply
    assert READ_TIMEOUT_S - 0.1 <= took <= READ_TIMEOUT_S + 3.0, took
    assert not _routed(reply)  # answered in the proxy, not by a replica


def _routed(reply: bytes) -> bool:
    """Whether a reply passed Ray's routing in the proxy, which tags it with x-request-id (the
    guard sits outside it, so its own refusals carry none)."""
    return b"\r\nx-request-id:" in reply.partition(b"\r\n\r\n")[0].lower()


@pytest.mark.slow
def test_replicas_answer_trickled_headers_408_within_the_read_timeout(cluster):
    """Headers sent a byte every 0.1 s: 408 at --read-timeout, as one process answers."""
    import socket
    import threading
    from urllib.parse import urlsplit

    parts = urlsplit(cluster)
    s = socket.create_connection((parts.hostname, parts.port), timeout=30)
    head = _predict_head(2)
    stop = threading.Event()

    def trickle():
        for i in range(len(head)):
            if stop.wait(0.1):
                return
            try:
                s.sendall(head[i : i + 1])
            except OSError:
                return

    sender = threading.Thread(target=trickle)
    t0 = time.monotonic()
    sender.start()
    try:
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
        took = time.monotonic() - t0
    finally:
        stop.set()
        sender.join(10)
        s.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:300]
    assert b"request headers not received within 2 s" in reply
    assert READ_TIMEOUT_S - 0.1 <= took <= READ_TIMEOUT_S + 3.0, took


@pytest.mark.slow
def test_replicas_answer_413_from_the_declared_length_before_the_body(cluster):
    """50 MB announced, none sent: 413 at once, so the proxy did not wait to read the body."""
    reply, took = _raw_reply(cluster, _predict_head(50 << 20))
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    want = b"request body too large: %d bytes; at most %d bytes" % (50 << 20, MAX_BODY_BYTES)
    assert want in reply
    assert took < READ_TIMEOUT_S, took
    assert not _routed(reply)  # refused in the proxy: the body never went on to a replica
    # within the limit, the same request is served, through the routing
    body = b'{"nodes": [1, 2]}'
    reply, _ = _raw_reply(cluster, _predict_head(len(body)) + body)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    assert _routed(reply)


def test_proxy_middlewares_carry_the_serve_bounds(monkeypatch):
    """What Ray's proxy calls: the guard with the bounds run_replicas put in the environment,
    nothing without them."""
    import uvicorn.config

    from quiver.serving import ServeConfig
    from quiver.serving import replicas as r
    from quiver.serving.http import ReadGuard

    # what the callback sets in Ray's proxy process; undone here, so this process's uvicorn
    # servers keep their protocol
    monkeypatch.setitem(
        uvicorn.config.HTTP_PROTOCOLS, "auto", uvicorn.config.HTTP_PROTOCOLS["auto"]
    )
    monkeypatch.setattr(r, "_PROXY_PROTOCOL", None)
    for name in (r._MAX_BODY_ENV, r._READ_TIMEOUT_ENV, r._PROXY_CALLBACK_ENV):
        monkeypatch.setenv(name, "")  # recorded, so the test's own settings are undone
        monkeypatch.delenv(name)
    assert r.proxy_middlewares() == []
    r._guard_the_proxy(ServeConfig(max_body_bytes=1234, read_timeout_s=0.75))
    assert os.environ[r._PROXY_CALLBACK_ENV] == "quiver.serving.replicas.proxy_middlewares"
    (mw,) = r.proxy_middlewares()
    guard = mw.cls(None, *mw.args, **mw.kwargs)
    assert isinstance(guard, ReadGuard)
    assert (guard.max_body_bytes, guard.read_timeout_s) == (1234, 0.75)
    # the proxy's uvicorn resolves its `auto` protocol to the guarded one
    from uvicorn.importer import import_from_string

    protocol = import_from_string(uvicorn.config.HTTP_PROTOCOLS["auto"])
    assert protocol is r._PROXY_PROTOCOL and protocol.__name__ == "GuardedHTTPProtocol"


def test_replicas_without_ray_is_one_line_error(trained, monkeypatch, capsys):
    d, ckpt = trained
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    rc = quiver_main(["serve", str(d), "--checkpoint", str(ckpt), "--replicas", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "--replicas needs Ray Serve" in err and "[scale]" in err


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--replicas", "0"], "--replicas must be >= 1"),
        (["--replicas", "3", "--max-replicas", "2"], "must lie within"),
        (["--min-replicas", "3", "--max-replicas", "2"], "must be <= --max-replicas"),
    ],
)
def test_bad_replica_options(trained, argv, msg, capsys):
    d, ckpt = trained
    assert quiver_main(["serve", str(d), "--checkpoint", str(ckpt), *argv]) == 2
    assert msg in capsys.readouterr().err


def test_single_process_server_does_not_import_ray():
    code = (
        "import sys, quiver.cli, quiver.commands.serve, quiver.serving.app, "
        "quiver.serving.server; assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_merge_metrics_labels_each_replica_once_per_family():
    from quiver.serving.replicas import merge_metrics

    text = (
        "# HELP q_total requests\n# TYPE q_total counter\nq_total 3.0\n"
        '# HELP lat latency\n# TYPE lat histogram\nlat_bucket{le="1"} 2.0\nlat_count 2.0\n'
    )
    merged = merge_metrics([("a", text), ("b", text.replace("3.0", "5.0"))])
    lines = merged.splitlines()
    assert lines.count("# TYPE q_total counter") == 1 and lines.count("# TYPE lat histogram") == 1
    assert lines.index('q_total{replica="b"} 5.0') == lines.index('q_total{replica="a"} 3.0') + 1
    assert 'lat_bucket{replica="a",le="1"} 2.0' in lines and 'lat_count{replica="b"} 2.0' in lines
    # the families stay contiguous: every sample follows its own family's TYPE line
    assert lines.index("# TYPE lat histogram") > lines.index('q_total{replica="b"} 5.0')
