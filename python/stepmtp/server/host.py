"""What the server's flags ask of the process and its socket: -C / -Cr / --prio
(the process's CPUs and priority, which every thread started later inherits, llama.cpp's
OpenMP team included) and --reuse-port (a listening socket with SO_REUSEPORT)."""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("stepmtp.server")

#: --prio's levels as nice values (ggml's: low, normal, medium, high, realtime)
NICE = {-1: 5, 0: 0, 1: -5, 2: -10, 3: -20}


def place_process(cpus: frozenset[int] | None, prio: int = 0) -> None:
    """The process on ``cpus`` (None: as started) at ``prio``. Called before any thread
    starts, so all of them run there. A CPU the process may not use, or a priority it
    may not take (above normal needs privileges), is a warning, as in llama-server."""
    if cpus is not None:
        allowed = os.sched_getaffinity(0)
        use = set(cpus) & allowed
        if not use:
            log.warning("-C/-Cr: none of CPUs %s is available to this process (%s): affinity unchanged",
                        sorted(cpus), sorted(allowed))
        else:
            if use != set(cpus):
                log.warning("-C/-Cr: CPUs %s are not available to this process", sorted(set(cpus) - allowed))
            os.sched_setaffinity(0, use)
            log.info("CPU affinity: %s", sorted(use))
    if prio != 0:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, NICE[prio])
        except OSError as e:
            log.warning("--prio %d: failed to set the process priority (nice %d): %s", prio, NICE[prio], e.strerror)


def listen_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """The listening socket uvicorn would open, with SO_REUSEPORT when asked (several
    servers on one port, the kernel spreading connections among them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
