"""Load is shed only when the server is behind on its own work (issue 43 item 5): a host kept
busy by a CPU-bound thread (which holds the GIL and makes the event loop lag) must not make an
idle server refuse sequential requests."""

import threading
import time

from quiver.serving import Engine, ServeConfig
from quiver.serving.app import create_app
from quiver.serving.client import Client
from quiver.serving.http import HTTPThread


def _spin(stop: threading.Event) -> None:
    """Pure-Python CPU work: holds the GIL for whole switch intervals, like a busy neighbour."""
    x = 0
    while not stop.is_set():
        for i in range(10_000):
            x += i * i


def test_sequential_requests_to_an_idle_server_on_a_busy_host_are_answered(world):
    # shedding on (the default) with a tight deadline: the lag the spinner causes is far
    # over the front door's bound, so only the "is the server behind?" rule keeps answering
    cfg = ServeConfig(slo_ms=10.0)
    assert cfg.shed_late
    eng = Engine(world.sampler, world.x, world.model, world.n, cfg)
    eng.start()
    http = HTTPThread(create_app(eng)).start()
    stop = threading.Event()
    spinners = [threading.Thread(target=_spin, args=(stop,), daemon=True) for _ in range(2)]
    try:
        with Client(http.url) as c:
            c.predict([1])  # warm: the first batch times the service
            for t in spinners:
                t.start()
            time.sleep(0.2)  # the loop's lag estimate rises under the spinners
            want = world.offline(list(range(8))).argmax(1).tolist()
            for i in range(8):  # one at a time: never more than one request in the server
                assert c.predict([i])["values"] == [want[i]]
    finally:
        stop.set()
        for t in spinners:
            if t.is_alive():
                t.join()
        http.stop()
        eng.stop()
