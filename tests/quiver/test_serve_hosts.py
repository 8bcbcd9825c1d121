"""Feature shards across serving hosts: ``PeerFeature`` (point-to-point over gloo, a responder
thread per host) and ``quiver serve --host-rank R --hosts K`` (real servers on loopback)."""

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from quiver.cli import main as quiver_main
from quiver.serving.http import free_port

NODES = [[3, 17, 0], [42], [17, 99, 150, 7], [199, 1]]
# all-neighbour fanouts: a node's subgraph is the same whatever the server served before
SERVE_ARGS = ["--fanouts=-1,-1", "--seed", "0", "--slo-ms", "5000", "--sampler-workers", "2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny dataset partitioned for 2 hosts (BFS owners, 20 FAP replicas each), a model."""
    from quiver.datasets import synthetic

    d = tmp_path_factory.mktemp("hosts")
    synthetic("tiny", seed=0, out=d)
    ckpt = d / "ckpt.pt"
    argv = ["train-model", str(d), "--out", str(ckpt), "--epochs", "1", "--fanouts", "5,3"]
    assert quiver_main(argv + ["--batch-size", "32", "--hidden", "16"]) == 0
    assert quiver_main(["partition", str(d), "--hosts", "2", "--replicate-budget", "20"]) == 0
    return d, ckpt


# ------------------------------------------------------------------------------ PeerFeature


def _gather_worker(rank, ports, directory, out_dir):
    from quiver.datasets import load_prepared
    from quiver.feature.partition import load_partition
    from quiver.feature.peer import PeerConfig, PeerFeature

    torch.set_num_threads(1)
    x = load_prepared(directory).features
    part = load_partition(directory)
    n = x.shape[0]
    local = part.local_ids(rank)
    remote_only = np.setdiff1d(np.arange(n), local)
    for port, dtype in zip(ports, (torch.float32, torch.bfloat16)):
        cfg = PeerConfig(host_rank=rank, hosts=2, peer_addr=f"127.0.0.1:{port}", join_timeout_s=60)
        feat = PeerFeature.from_prepared(directory, cfg, dtype=dtype, num_threads=1)
        want = x.to(dtype)
        fixed = [
            torch.zeros(0, dtype=torch.int64),  # empty: no exchange
            torch.from_numpy(local[:30]),  # only local rows
            torch.from_numpy(remote_only[:25]),  # only the other host's rows
            torch.from_numpy(np.concatenate([local[:4], remote_only[:4]] * 3)),  # duplicates
        ]
        errors = []

        def run(i, feat=feat, want=want, fixed=fixed, errors=errors):
            gen = torch.Generator().manual_seed(100 * rank + i)
            cases = fixed + [torch.randint(0, n, (int(k),), generator=gen) for k in range(1, 60)]
            for ids in cases:
                got = feat[ids]
                if got.dtype != want.dtype or not torch.equal(got, want[ids]):
                    errors.append(ids)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a gather hung"
        assert not errors, f"host {rank}: {len(errors)} gathers differ from x[n_id]"
        s = feat.stats()
        assert s["remote_rows"] > 0 and s["served_rows"] > 0 and s["bytes_received"] > 0
        assert s["rows"] == {"local": s["local_rows"], "remote": s["remote_rows"]}
        with pytest.raises(ValueError, match="node ids must lie in"):
            feat[torch.tensor([n])]
        assert feat.close() is True, feat.peers()  # both said BYE: the group is destroyed
        with pytest.raises(RuntimeError, match="closed"):
            feat[torch.from_numpy(remote_only[:2])]
    torch.save(rank, os.path.join(out_dir, f"ok{rank}.pt"))


@pytest.mark.dist
def test_two_hosts_gather_exactly_x_of_n_id_from_any_thread(trained, tmp_path):
    """Three threads per host gather at once (not a collective), fp32 then bf16 rows."""
    d, _ = trained
    ports = (free_port(), free_port())
    t0 = time.monotonic()
    mp.start_processes(
        _gather_worker, args=(ports, str(d), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    assert (tmp_path / "ok0.pt").exists() and (tmp_path / "ok1.pt").exists()
    print(f"2 hosts x 3 threads x 2 dtypes in {time.monotonic() - t0:.1f} s")


def _join(cfg, fingerprint, out, key):
    from quiver.feature.peer import join_hosts

    try:
        out[key] = join_hosts(cfg, fingerprint)
    except ValueError as e:
        out[key] = e


def _join_all(specs):
    from quiver.feature.peer import PeerConfig

    out = {}
    threads = []
    for key, (rank, hosts, fp, port, timeout) in specs.items():
        cfg = PeerConfig(
            host_rank=rank, hosts=hosts, peer_addr=f"127.0.0.1:{port}", join_timeout_s=timeout
        )
        threads.append(threading.Thread(target=_join, args=(cfg, fp, out, key)))
        threads[-1].start()
        time.sleep(0.05 if rank == 0 else 0)  # host 0's store first (others retry anyway)
    for t in threads:
        t.join(30)
    return out


def test_rendezvous_refuses_a_taken_rank_a_missing_host_and_another_partition():
    port = free_port()
    out = _join_all({"h0": (0, 2, "a", port, 5), "h1": (1, 2, "a", port, 5)})
    assert not isinstance(out["h0"], Exception) and not isinstance(out["h1"], Exception)
    # a second rank 1 at the same store
    late = _join_all({"dup": (1, 2, "a", port, 2)})
    assert "host rank 1 is already taken" in str(late["dup"])
    del out
    port = free_port()
    out = _join_all({"h0": (0, 2, "a", port, 5), "h1": (1, 2, "b", port, 5)})
    for key in ("h0", "h1"):
        assert isinstance(out[key], ValueError) and "another partition" in str(out[key])
    port = free_port()
    out = _join_all({"h0": (0, 3, "a", port, 1)})
    assert "hosts [1, 2] did not join" in str(out["h0"])


def test_peer_config_validates_its_fields():
    from quiver.feature.peer import PeerConfig

    with pytest.raises(ValueError, match=r"--host-rank must lie in \[0, 2\)"):
        PeerConfig(host_rank=2, hosts=2)
    with pytest.raises(ValueError, match="--hosts must be >= 1"):
        PeerConfig(host_rank=0, hosts=0)
    with pytest.raises(ValueError, match="HOST:PORT"):
        PeerConfig(host_rank=0, hosts=2, peer_addr="localhost")
    with pytest.raises(ValueError, match="peer_timeout_s must be > 0"):
        PeerConfig(host_rank=0, hosts=2, peer_timeout_s=0)
    assert PeerConfig(host_rank=1, hosts=2, peer_addr="[::1]:29500").address() == ("::1", 29500)


# --------------------------------------------------------------------------- quiver serve


def _spawn_hosts(d, ckpt, extra=()):
    from quiver.serving.http import spawn_serve

    peer = f"127.0.0.1:{free_port()}"
    hosts = []
    for r in range(2):
        args = [*SERVE_ARGS, "--host-rank", str(r), "--hosts", "2", "--peer-addr", peer, *extra]
        hosts.append(spawn_serve(d, ckpt, *args))
    return hosts


def _wait_ready(hosts, timeout=180):
    from quiver.serving.client import wait_until_ready

    for proc, url in hosts:
        wait_until_ready(url, timeout=timeout, proc=proc)


def _stop(hosts, timeout=60):
    """SIGTERM every host; each must exit 0 within ``timeout``: ``[(rc, output)]``."""
    for proc, _ in hosts:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    out = []
    for proc, _ in hosts:
        try:
            rc = proc.wait(timeout=timeout)
        except Exception:
            proc.kill()
            raise
        out.append((rc, proc.stdout.read()))
    return out


@pytest.mark.dist
@pytest.mark.slow  # two `quiver serve` processes: ~15-30 s of start-up on 2 busy cores
def test_two_serving_hosts_answer_the_single_process_logits(trained):
    """Two ``quiver serve --host-rank`` processes answer exactly what one server holding every
    row answers, directly and through the router, and under concurrent load. SIGTERM to host 0
    first: host 1 still answers (host 0 keeps answering its row requests until host 1 stops
    too); then SIGTERM to host 1: both exit 0, cleanly."""
    import httpx

    from quiver.serving import ServeConfig
    from quiver.serving.routing import RoutedClient
    from quiver.serving.server import Server

    d, ckpt = trained
    t0 = time.monotonic()
    hosts = _spawn_hosts(d, ckpt)
    try:
        cfg = ServeConfig(slo_ms=5000, num_sampler_workers=2)
        # hosts serve the raw features (a host never folds), so the reference does not either
        with Server.from_dataset(d, ckpt, cfg, fanouts=[-1, -1], seed=0, fold="off") as server:
            want = [server.predict(nodes, output="logits").values for nodes in NODES]
        _wait_ready(hosts)
        print(f"2 hosts up in {time.monotonic() - t0:.1f} s")
        urls = [url for _, url in hosts]
        for url in urls:
            with httpx.Client(base_url=url, timeout=30) as c:
                for nodes, w in zip(NODES, want):
                    r = c.post("/v1/predict", json={"nodes": nodes, "output": "logits"})
                    assert r.status_code == 200, r.text
                    np.testing.assert_array_equal(np.array(r.json()["values"], np.float32), w)
                # bad ids: the same validation as one process
                assert c.post("/v1/predict", json={"nodes": [10**6]}).status_code == 422
        with RoutedClient(urls, d) as routed:
            for nodes, w in zip(NODES, want):
                body = routed.predict(nodes, output="logits")
                assert body["host"] == routed.host_for(nodes)
                np.testing.assert_array_equal(np.array(body["values"], np.float32), w)

        def one(i):  # concurrent: batches mix requests, so compare to float rounding
            nodes = NODES[i % len(NODES)]
            with httpx.Client(base_url=urls[i % 2], timeout=30) as c:
                r = c.post("/v1/predict", json={"nodes": nodes, "output": "logits"})
            return i, r.status_code, r.json()

        with ThreadPoolExecutor(8) as pool:
            for i, status, body in pool.map(one, range(48)):
                assert status == 200, body
                np.testing.assert_allclose(body["values"], want[i % len(NODES)], atol=1e-5)
        remote = 0.0
        for url in urls:
            text = httpx.get(url + "/metrics", timeout=10).text
            line = [ln for ln in text.splitlines() if ln.startswith("quiver_feature_rows_total")]
            remote += sum(float(ln.split()[-1]) for ln in line if 'tier="remote"' in ln)
        assert remote > 0  # the hosts did read each other's rows
        # host 0 stops first: it keeps answering host 1's row requests until host 1 stops
        (p0, url0), (p1, url1) = hosts
        p0.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(url0 + "/healthz", timeout=1)
            except httpx.HTTPError:
                break  # its HTTP server is down: it drains, said BYE and lingers
            time.sleep(0.1)
        with httpx.Client(base_url=url1, timeout=30) as c:
            for nodes, w in zip(NODES, want):
                r = c.post("/v1/predict", json={"nodes": nodes, "output": "logits"})
                assert r.status_code == 200, r.text
                np.testing.assert_array_equal(np.array(r.json()["values"], np.float32), w)
        assert p0.poll() is None, "host 0 left while host 1 still served"
    finally:
        results = _stop(hosts)
    for rc, output in results:
        assert rc == 0, output[-3000:]
        assert "quiver serve: stopped\n" in output, output[-3000:]
    print(f"whole test {time.monotonic() - t0:.1f} s")


@pytest.mark.dist
@pytest.mark.slow  # two `quiver serve` processes
def test_a_host_whose_peer_dies_answers_errors_not_hangs(trained):
    """SIGKILL one host: the other answers every request (200, or 500 for rows it cannot
    read) within the peer timeout, stays healthy, and SIGTERM still stops it (exit 0)."""
    import httpx

    d, ckpt = trained
    t0 = time.monotonic()
    hosts = _spawn_hosts(d, ckpt, ["--peer-timeout", "5"])
    try:
        _wait_ready(hosts)
        print(f"2 hosts up in {time.monotonic() - t0:.1f} s")
        (p0, url0), (p1, _) = hosts
        with httpx.Client(base_url=url0, timeout=30) as c:
            assert c.post("/v1/predict", json={"nodes": [1, 2]}).status_code == 200
            p1.kill()
            p1.wait(timeout=10)
            statuses = []
            for nodes in NODES * 3:
                t = time.monotonic()
                r = c.post("/v1/predict", json={"nodes": nodes})
                assert time.monotonic() - t < 10, "a request waited past the peer timeout"
                statuses.append(r.status_code)
                if r.status_code == 500:
                    assert "host 1" in r.json()["error"]
            assert set(statuses) <= {200, 500} and 500 in statuses, statuses
            assert c.get("/healthz").status_code == 200
            print(f"answers after the kill: {statuses}, {time.monotonic() - t0:.1f} s")
    finally:
        t = time.monotonic()
        results = _stop(hosts[:1], timeout=60)
    assert results[0][0] == 0, results[0][1][-3000:]
    assert time.monotonic() - t < 30
    print(f"host 0 stopped in {time.monotonic() - t:.1f} s: {results[0][1].splitlines()[-1]}")


def test_serve_host_options_bad_input_is_one_line_error(trained, tmp_path, capsys):
    d, ckpt = trained
    base = ["serve", str(d), "--checkpoint", str(ckpt), "--port", str(free_port())]
    unpartitioned = tmp_path / "plain"
    from quiver.datasets import synthetic

    synthetic("tiny", seed=1, out=unpartitioned)
    cases = [
        (["--host-rank", "2", "--hosts", "2"], r"--host-rank must lie in [0, 2)"),
        (["--host-rank", "0"], "needs both --host-rank R and --hosts K"),
        (["--host-rank", "0", "--hosts", "3"], "the partition is for 2 hosts, --hosts is 3"),
        (
            ["--host-rank", "0", "--hosts", "2", "--partition-dir", str(tmp_path / "nope")],
            "partition directory not found",
        ),
        (
            ["--host-rank", "0", "--hosts", "2", "--partition-dir", str(unpartitioned)],
            "has no partition",
        ),
        (["--host-rank", "0", "--hosts", "2", "--peer-addr", "nohost"], "HOST:PORT"),
        (
            ["--host-rank", "1", "--hosts", "2", "--join-timeout", "1"]
            + ["--peer-addr", f"127.0.0.1:{free_port()}"],
            "host 0 did not answer within 1 s",
        ),
    ]
    for extra, message in cases:
        rc = quiver_main(base + extra)
        err = capsys.readouterr().err
        assert rc == 2, (extra, err)
        assert message in err and "Traceback" not in err, (extra, err)
        assert len(err.strip().splitlines()) == 1, err
