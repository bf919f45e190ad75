"""ggml's RPC backend: a model's layers on ``rpc-server`` processes, local or on other hosts.

``Model(path, rpc="host:port,host:port", n_gpu_layers=...)`` loads a model with the
servers' devices in front of the local GPUs (llama.cpp's order: RPC devices count as
GPU devices, and ``n_gpu_layers`` decides how many layers leave the CPU). The devices
are handed to llama.cpp per model (``llama_model_params.devices``) rather than
registered process-wide as llama-server does: a process-wide registration would put
every later model of the process on those servers too, and a later local model would
fail once a server is gone.

Failures are ``RPCError`` naming the server:
- before a load, each server not already in use by this process is probed with the
  RPC handshake under a timeout, because ggml's own connect has none (an unreachable
  host takes the kernel's ~2 minute SYN timeout) and its handshake waits forever on a
  server busy with another client (rpc-server serves one client at a time);
- a connection lost later (server stopped or crashed) makes the next decode raise;
  patches/0005 keeps ggml from aborting the process there, and the model can still be
  closed. It cannot be used again: its weights on that server are gone.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import weakref
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

from .binding import ErrorCapture, LlamaError, ensure_backend, ffi, lib

log = logging.getLogger("stepmtp.rpc")

__all__ = ["RPCError", "parse_servers", "rpc_available", "rpc_server_path", "DEFAULT_PORT", "probe"]

#: rpc-server's default port
DEFAULT_PORT = 50052

#: seconds a server has to accept the connection and answer the handshake
#: (environment: STEPMTP_RPC_TIMEOUT)
PROBE_TIMEOUT_S = float(os.environ.get("STEPMTP_RPC_TIMEOUT", "") or 10.0)

# RPC_CMD_HELLO in ggml-rpc.cpp (fixed by the protocol: "must be always 14"), and the
# sizes of its request (the transport capabilities, RPC_CONN_CAPS_SIZE) and response
# (major, minor, patch, padding, capabilities)
_CMD_HELLO = 14
_CAPS_SIZE = 24
_HELLO_RSP_SIZE = 4 + _CAPS_SIZE


class RPCError(LlamaError):
    """An RPC server could not be reached, refused the handshake, or was lost; the
    message names it (``host:port``)."""


def rpc_server_path() -> Path:
    """The ``rpc-server`` binary installed with the package (``python -m
    stepmtp.rpc_server`` runs it)."""
    from importlib import resources

    # through the package's resources: an editable install keeps the binaries apart from the sources
    p = Path(str(resources.files(__package__).joinpath("bin", "rpc-server.exe" if os.name == "nt" else "rpc-server")))
    if not p.is_file():
        raise FileNotFoundError(f"{p}: not installed (this build was made with -DSTEPMTP_RPC=off)")
    return p


def rpc_available() -> bool:
    """True when this build has ggml's RPC backend."""
    ensure_backend()
    return lib.ggml_backend_reg_by_name(b"RPC") != ffi.NULL


def parse_servers(servers: str | Iterable[str] | None) -> list[str]:
    """``"h1:p1,h2:p2"`` (llama-server's ``--rpc``) or a list of ``host:port`` as a list
    of endpoints, duplicates dropped (a server's devices are used once)."""
    if servers is None:
        return []
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    out: list[str] = []
    for item in items:
        ep = str(item).strip()
        if not ep:
            continue
        host, sep, port = ep.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"RPC server {ep!r}: expected host:port (e.g. 192.168.1.10:{DEFAULT_PORT})")
        ep = f"{host}:{int(port)}"
        if ep not in out:
            out.append(ep)
    return out


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("connection closed")
        buf += chunk
    return buf


def probe(endpoint: str, timeout: float | None = None) -> tuple[int, int, int]:
    """Connect to an rpc-server and run the protocol's handshake; returns its version.

    Raises RPCError (saying what failed) for a host that does not resolve, a refused
    or timed-out connection, a peer that is not a compatible rpc-server, or one that
    does not answer (rpc-server serves one client at a time: another process using it
    makes it wait)."""
    timeout = PROBE_TIMEOUT_S if timeout is None else timeout
    host, _, port_s = endpoint.rpartition(":")
    port = int(port_s)
    try:
        # IPv4 only, as ggml's client (gethostbyname)
        addr = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4]
    except socket.gaierror as e:
        raise RPCError(f"RPC server {endpoint}: cannot resolve host {host!r} ({e.strerror})") from None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(addr)
        except ConnectionRefusedError:
            raise RPCError(f"RPC server {endpoint}: connection refused (is rpc-server running there, "
                           f"listening on {port} on an address this host reaches?)") from None
        except socket.timeout:
            raise RPCError(f"RPC server {endpoint}: no answer to the connection within {timeout:g} s "
                           "(host down, or the port blocked by a firewall)") from None
        except OSError as e:
            raise RPCError(f"RPC server {endpoint}: cannot connect ({e.strerror or e})") from None
        try:
            sock.sendall(struct.pack("<BQ", _CMD_HELLO, _CAPS_SIZE) + bytes(_CAPS_SIZE))
            (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
            if size != _HELLO_RSP_SIZE:
                raise RPCError(f"RPC server {endpoint}: unexpected handshake answer ({size} bytes): not an "
                               "rpc-server of this llama.cpp version")
            major, minor, patch = _recv_exact(sock, size)[:3]
        except socket.timeout:
            raise RPCError(f"RPC server {endpoint}: accepted the connection but did not answer the handshake "
                           f"within {timeout:g} s (rpc-server serves one client at a time: is another process "
                           "using it? or it is not an rpc-server)") from None
        except OSError as e:
            raise RPCError(f"RPC server {endpoint}: the connection failed during the handshake ({e}): not an "
                           "rpc-server, or one of another protocol version") from None
    finally:
        sock.close()
    want_major, want_minor = lib.RPC_PROTO_MAJOR_VERSION, lib.RPC_PROTO_MINOR_VERSION
    if major != want_major or minor > want_minor:
        raise RPCError(f"RPC server {endpoint}: protocol version {major}.{minor}.{patch}, this build speaks "
                       f"{want_major}.{want_minor}: run an rpc-server of the same llama.cpp version")
    return major, minor, patch


class ModelHandle(Protocol):
    """What the servers need of a model using them (``llama.Model``, which imports
    this module): its llama.cpp pointer, NULL once closed."""

    _ptr: Any


class _Registry:
    """The servers this process has added to ggml, their devices, and the models that
    use them (whose open connection a probe would have to queue behind)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.devices: dict[str, list] = {}
        self.users: dict[str, weakref.WeakSet[ModelHandle]] = {}
        self._fns = None

    def fns(self):  # noqa: ANN201 - a pair of cffi function pointers
        if self._fns is None:
            ensure_backend()
            reg = lib.ggml_backend_reg_by_name(b"RPC")
            if reg == ffi.NULL:
                raise RPCError("this build of stepmtp has no RPC backend (it was built with -DSTEPMTP_RPC=off)")
            add = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
            fails = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_get_n_failures")
            if add == ffi.NULL or fails == ffi.NULL:
                raise RPCError("the RPC backend lacks ggml_backend_rpc_add_server / _get_n_failures "
                               "(an unpatched llama.cpp?)")
            self._fns = (ffi.cast("ggml_backend_reg_t (*)(const char *)", add),
                         ffi.cast("uint64_t (*)(const char *)", fails))
        return self._fns

    def in_use(self, endpoint: str) -> bool:
        return any(m._ptr != ffi.NULL for m in self.users.get(endpoint, ()))

    def devices_of(self, endpoint: str, timeout: float | None) -> list:
        add, _ = self.fns()
        with self.lock:
            if not self.in_use(endpoint):
                probe(endpoint, timeout)
            devs = self.devices.get(endpoint)
            if devs is None:
                # ggml keeps one registry per endpoint for the process: a second add
                # returns the same devices, which are listed here once
                with ErrorCapture() as cap:
                    reg = add(endpoint.encode())
                if reg == ffi.NULL:
                    raise RPCError(cap.message(f"RPC server {endpoint}: ggml could not add it"))
                devs = [lib.ggml_backend_reg_dev_get(reg, i) for i in range(lib.ggml_backend_reg_dev_count(reg))]
                if not devs:
                    raise RPCError(f"RPC server {endpoint}: offers no device")
                self.devices[endpoint] = devs
            return devs

    def add_user(self, endpoint: str, model: ModelHandle) -> None:
        with self.lock:
            self.users.setdefault(endpoint, weakref.WeakSet()).add(model)


_registry = _Registry()


def _local_devices() -> list:
    """The local devices llama.cpp would offload to by default: the GPUs, else the
    first integrated GPU (RPC devices are never registered process-wide here)."""
    gpus, igpus = [], []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        kind = lib.ggml_backend_dev_type(dev)
        if kind == lib.GGML_BACKEND_DEVICE_TYPE_GPU:
            gpus.append(dev)
        elif kind == lib.GGML_BACKEND_DEVICE_TYPE_IGPU:
            igpus.append(dev)
    return gpus or igpus[:1]


class Servers:
    """The RPC servers of one model: the device list for its load, and the check that
    none of their connections was lost since (``check``)."""

    def __init__(self, servers: Sequence[str], *, n_gpu_layers: int = -1, timeout: float | None = None) -> None:
        self.endpoints = list(servers)
        if n_gpu_layers == 0:
            log.warning("RPC servers %s given with n_gpu_layers=0: no layer goes to them (-ngl N or 'all')",
                        ",".join(self.endpoints))
        devs: list = []
        for ep in self.endpoints:
            devs += _registry.devices_of(ep, timeout)
        #: the servers' devices alone (what -dev and -ot may name besides the local ones)
        self.remote_devices = devs
        # the servers first, as llama.cpp orders them (fewer transfers over the network)
        self.devices = ffi.new("ggml_backend_dev_t[]", devs + _local_devices() + [ffi.NULL])
        self.device_names = [ffi.string(lib.ggml_backend_dev_name(d)).decode() for d in devs]
        # checked after every decode: the C function and its arguments ready
        self._n_failures = _registry.fns()[1]
        self._keys = [ep.encode() for ep in self.endpoints]
        self._base = [self._n_failures(k) for k in self._keys]

    def lost(self) -> list[str]:
        return [ep for ep, k, n in zip(self.endpoints, self._keys, self._base) if self._n_failures(k) != n]

    def check(self, what: str) -> None:
        """Raise RPCError when a connection of these servers failed since the load."""
        lost = self.lost()
        if lost:
            raise RPCError(
                f"{what}: lost the connection to RPC server {', '.join(lost)} (stopped, crashed or unreachable); "
                "the model's layers there are gone: close it and load it again once the server is back")

    def attach(self, model: ModelHandle) -> None:
        for ep in self.endpoints:
            _registry.add_user(ep, model)
