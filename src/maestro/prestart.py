"""What ``maestro train`` does before it imports torch: start the ranks' fork server.

``maestro train`` spawns its ranks from a fork server that imports torch and the runtime once
(``PRELOAD``), so each rank forks with them loaded. The server imports them in its own process,
so starting it before the launcher itself imports torch and loads the job (``prestart``, the
first thing ``maestro train`` does) overlaps the two: about a second of the time to the first
step on a 2-core machine. Nothing here imports torch (so it lives outside
``maestro.runtime``, whose package imports the launcher and torch).
"""

from __future__ import annotations

import os

#: what the fork server imports once, so each rank forks with them loaded (seconds per rank)
PRELOAD = [
    "torch",
    "torch.distributed",
    # torch._dynamo (pulled in by FSDP2, DTensor, torch.compile and the FLOP counter of the
    # cost model) takes 1.6 s to import on this 2-core EPYC; preloaded once in the fork server
    # instead of once per rank
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "torch.distributed.checkpoint",
    "maestro.runtime.launch",
    "maestro.runtime.executor",
]


def start_method() -> str:
    """``forkserver`` with torch and the runtime preloaded where the platform has it: a rank
    then starts in a fraction of a second instead of importing torch afresh (``spawn``).
    The fork server is a clean single-threaded process that never touched CUDA or gloo, so
    forking it is as safe as spawning. ``MAESTRO_START_METHOD=spawn`` restores spawning."""
    import multiprocessing as std_mp

    want = os.environ.get("MAESTRO_START_METHOD", "forkserver")
    if want not in std_mp.get_all_start_methods():
        return "spawn"
    if want == "forkserver":
        std_mp.set_forkserver_preload(PRELOAD)
    return want


def prestart() -> None:
    """Start the fork server now (it preloads in the background; nothing waits for it)."""
    if start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    try:
        forkserver.ensure_running()
    except OSError:  # the launcher starts it again when it needs it, or says why it cannot
        pass


def stop() -> None:
    """Stop a fork server this process started (when it exits before starting ranks, so the
    server does not outlive it while it finishes its imports)."""
    import signal
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if pid is None:
        return
    try:
        if fd is not None:
            os.close(fd)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (OSError, ChildProcessError):
        pass
    for attr in ("_forkserver_pid", "_forkserver_alive_fd", "_forkserver_address"):
        if hasattr(server, attr):
            setattr(server, attr, None)
