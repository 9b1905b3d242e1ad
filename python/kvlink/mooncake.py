"""Mooncake's `mooncake.engine` API over kvlink.

vLLM's MooncakeConnector and SGLang's mooncake backend drive
`mooncake.engine.TransferEngine`; this module has the same class, method
names, positional order, defaults and integer results, so that they run on
kvlink unchanged (see the README, "Python", for how `import mooncake.engine`
finds it). What differs, and why:

- Metadata: "P2PHANDSHAKE" (as vLLM and SGLang use it): a session is
  "host:port" with the port from the peer's get_rpc_port(); the engine listens
  on `local_hostname`'s address on a port of its own choosing (with
  MC_LEGACY_RPC_PORT_BINDING, on the port in local_hostname). With a
  metadata server, "etcd://host:2379[,host:2379...]", a bare "host:2379"
  (etcd, as in Mooncake; initialize_ext's metadata_type "http" makes it
  "http://host:port/metadata") or "http://host:port/metadata" (Mooncake's HTTP
  metadata server), the engine publishes itself under the name
  `local_hostname`, listens on its address (on its port when it has one, on
  one of its own choosing otherwise), and a session is a peer's
  local_hostname, resolved through the store (kvlink's `metadata` and `name`
  settings; KVLINK_METADATA_USER etc. for etcd's auth and TLS). "redis://"
  gives -1: kvlink has no redis backend. A store that cannot be reached gives
  -1 with its URL.
- Peer buffer addresses are the peer's virtual addresses inside its
  registered buffers, as in Mooncake: kvlink maps each to (segment, offset)
  through the segments the peer advertises in the handshake.
- protocol: "tcp"; "rdma" uses kvlink's RDMA transport where this build has
  it and the machine a usable device, and TCP otherwise, saying so on the
  "kvlink.mooncake" logger. Either way a peer on the same host (same kernel
  and PID namespace, allowed to attach) gets kvlink's one-copy shm
  transport. MC_FORCE_TCP forces TCP. Other protocols
  (nvlink, efa, hip, ...) give -1. MC_TRANSFER_TIMEOUT (seconds, at least 5,
  default 30) plus 1 s per GB bounds each transfer, as in Mooncake.
- Failure values are Mooncake's (mooncake-integration/transfer_engine/
  transfer_engine_py.cpp), with the reason on the "kvlink.mooncake" logger:
  -1 from initialize, the sync transfers, get_batch_transfer_status and
  send_probe; Mooncake's error codes from the memory calls (-7
  ERR_ADDRESS_OVERLAPPED for an overlapping registration, -3
  ERR_ADDRESS_NOT_REGISTERED to unregister an unknown address, -1
  ERR_INVALID_ARGUMENT otherwise); 0 from allocate_managed_buffer and
  get_first_buffer_address. Batch ids are unsigned 64-bit there, so
  Mooncake's `return -1` reaches Python as 2**64 - 1 (INVALID_BATCH in its
  C API): transfer_submit_write gives that on any failure, and
  batch_transfer_async* give it for a peer that cannot be reached and 0 for
  a batch refused at submission (lists of different lengths, a bad entry).
  Nothing is left half-done: a batch with a bad entry moves nothing, and
  every call that returns has finished touching memory, except the async
  ones, whose ids are waited for by get_batch_transfer_status /
  transfer_check_status. Where Mooncake has no failure value kvlink keeps
  one: free_managed_buffer of an address it did not allocate and
  write_bytes_to_buffer outside registered memory give -1 (Mooncake frees
  or writes whatever it is given).
- Memory: host memory, and GPU memory where the engine has a device runtime
  (kvlink's `device` setting, KVLINK_DEVICE: "auto", the default, is CUDA
  where this build has kvlink::cuda and a GPU is present; "emulated" is the
  CPU-only stand-in for tests and CI). register_memory(ptr, len, "cuda:N")
  (batch_register_memory too) registers device memory, which transfers move
  through the device's copy engine and pinned staging; with location "*" the
  runtime finds device memory itself. Without a device runtime a "cuda"
  location gives -1 saying so; "npu", "musa" and "hip" give -1.
  allocate_managed_buffer maps and registers one buffer per call (no slab
  pool); write_bytes_to_buffer / read_bytes_from_buffer accept only memory
  registered with this engine (device memory through its copy engine).
  transfer_write_on_cuda / transfer_read_on_cuda / batch_transfer_*_on_cuda
  (Mooncake's signatures, stream_ptr a cudaStream_t as an int) wait for the
  work queued on the stream before them, then transfer and return once the
  bytes are in place, so work queued on the stream afterwards sees them (the
  caller blocks where Mooncake's stream does); a failure raises RuntimeError
  (Mooncake's stream callback exits the process).
- get_engine() / get_engine_ptr() (Mooncake's C++ engine, for mooncake.store)
  raise NotImplementedError.

KVLINK_* variables (kvlink.config_table()) apply too, e.g. KVLINK_AUTH_SECRET.
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import sys
import threading
from typing import Any, Dict, List, Optional

import kvlink
from kvlink import _kvlink

__all__ = ["TransferEngine", "TransferOpcode", "TransferNotify", "Read", "Write",
           "SUPPORT_CUDA", "SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_MNNVL", "SUPPORT_INTRA_NVLINK"]

log = logging.getLogger("kvlink.mooncake")

# Whether this build reaches CUDA memory (kvlink::cuda linked), as Mooncake's
# flag says whether it was built with CUDA; a GPU is still needed at run time.
SUPPORT_CUDA = bool(getattr(_kvlink, "HAS_CUDA", False))
SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_MNNVL = False
SUPPORT_INTRA_NVLINK = False

P2PHANDSHAKE = "P2PHANDSHAKE"

# Mooncake's error codes (mooncake-transfer-engine/include/error.h), where its
# binding passes them on.
_ERR_INVALID_ARGUMENT = -1
_ERR_ADDRESS_NOT_REGISTERED = -3
_ERR_ADDRESS_OVERLAPPED = -7
# Mooncake's batch ids are uint64 (batch_id_t): its `return -1` from
# transfer_submit_write and batch_transfer_async* reaches Python as this.
_INVALID_BATCH = 2**64 - 1


class TransferOpcode(enum.IntEnum):
    """Mooncake's opcode (its members are Read and Write; READ/WRITE alias them)."""
    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A notification sent with a transfer: the peer's get_notifies() returns
    it once the data is in its memory."""

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _session(name: str) -> str:
    """kvlink's "host:port" for a Mooncake session name: an IPv6 host without
    brackets ("::1:12345", as f"{host}:{port}" builds it) gets them."""
    host, sep, port = name.rpartition(":")
    if sep and ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return name


def _metadata_url(server: str, kind: str) -> Optional[str]:
    """kvlink's `metadata` setting for Mooncake's (metadata_server,
    metadata_type): "" for the handshake, None when kvlink has no such store."""
    server, kind = server.strip(), kind.strip().lower()
    if server == P2PHANDSHAKE or kind in ("p2p", P2PHANDSHAKE.lower()):
        return "" if server == P2PHANDSHAKE else None
    scheme, sep, _ = server.partition("://")
    if sep:
        return server if scheme.lower() in ("etcd", "http", "https") else None
    if not server:
        return None
    if kind in ("", "etcd"):
        return f"etcd://{server}"
    if kind == "http":
        return f"http://{server}" if "/" in server else f"http://{server}/metadata"
    return None


def _listen_host(local_hostname: str) -> tuple:
    """(host, port) of Mooncake's local_hostname ("10.0.0.1", "10.0.0.1:12345", "[::1]:0", "::1")."""
    text = local_hostname.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else 0
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, int(port) if port.isdigit() else 0
    return text, 0  # a bare host name or IPv6 address


class TransferEngine:
    """Mooncake's TransferEngine over kvlink. Thread-safe; transfers release
    the GIL and wait on their completion (no polling)."""

    TransferOpcode = TransferOpcode

    def __init__(self) -> None:
        timeout = os.environ.get("MC_TRANSFER_TIMEOUT")
        try:
            self._timeout_s = max(5, int(timeout)) if timeout else 30
        except ValueError:
            self._timeout_s = 30
        self._engine: Optional[kvlink.Engine] = None
        self._lock = threading.Lock()
        self._peers: Dict[str, kvlink.Peer] = {}
        self._batches: Dict[int, _kvlink.Operation] = {}
        self._batch_ids = itertools.count(1)
        self._managed: Dict[int, int] = {}  # address -> length
        self._connect_limit = 6.0  # seconds; from the engine's connect_timeout
        self._by_name = False  # peers are names in a metadata store, not host:port

    # ------------------------------------------------------------ set-up

    def initialize(self, local_hostname, metadata_server, protocol, device_name, /) -> int:
        return self.initialize_ext(local_hostname, metadata_server, protocol, device_name, "")

    def initialize_ext(self, local_hostname, metadata_server, protocol, device_name,
                       metadata_type, /) -> int:
        if self._engine is not None:
            log.error("initialize: this TransferEngine is already initialized")
            return -1
        store = _metadata_url(str(metadata_server or ""), str(metadata_type or ""))
        if store is None:
            log.error("initialize: metadata server %r (%s): kvlink's stores are etcd "
                      "(\"etcd://host:2379\" or \"host:2379\") and Mooncake's HTTP metadata server "
                      "(\"http://host:port/metadata\"); or use \"P2PHANDSHAKE\"", metadata_server,
                      metadata_type)
            return -1
        proto = (protocol or "tcp").lower()
        settings: Dict[str, Any] = {}
        # A peer on this host is reached with one copy (shm) whatever the
        # protocol says; MC_FORCE_TCP=1 keeps everything on TCP.
        if _env_true("MC_FORCE_TCP") and proto in ("tcp", "rdma"):
            settings["transports"] = "tcp"
        elif proto == "tcp":
            settings["transports"] = "shm,tcp"
        elif proto == "rdma":
            if _kvlink.HAS_RDMA:
                settings["transports"] = "shm,rdma,tcp"
                if device_name:
                    settings["rdma_devices"] = device_name
            else:
                log.warning("protocol 'rdma': this kvlink build has no RDMA transport; using TCP")
                settings["transports"] = "shm,tcp"
        else:
            log.error("initialize: protocol %r is not available in kvlink (it has tcp and rdma)",
                      protocol)
            return -1
        host, port = _listen_host(local_hostname or "127.0.0.1")
        if store:
            settings["metadata"] = store
            settings["name"] = str(local_hostname)
        elif not _env_true("MC_LEGACY_RPC_PORT_BINDING"):
            port = 0  # P2PHANDSHAKE: a port of the engine's own choosing
        settings["listen"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self._engine = kvlink.Engine(**settings)
        except kvlink.Error as e:
            log.error("initialize: %s", e)
            return -1
        self._connect_limit = self._engine.config["connect_timeout"] / 1000 + 1
        offer = self._engine.transports
        usable = offer.split(" (", 1)[0].split(",")
        if proto == "rdma" and "rdma" not in usable:
            log.warning("protocol 'rdma': falling back to TCP: %s", offer)
        self._by_name = bool(store)
        return 0

    def get_rpc_port(self, /) -> int:
        if self._engine is None:
            return -1
        return int(self._engine.listen_address.rpartition(":")[2])

    def get_engine(self, /):
        raise NotImplementedError(
            "kvlink.mooncake: get_engine() returns Mooncake's C++ engine (for mooncake.store); "
            "kvlink has none to give. Use this TransferEngine's methods.")

    def get_engine_ptr(self, /):
        raise NotImplementedError("kvlink.mooncake: get_engine_ptr(): see get_engine()")

    def get_local_topology(self, device_name=None):
        raise NotImplementedError(
            "kvlink.mooncake: get_local_topology(): kvlink picks devices itself; see "
            "kvlink.Engine.transports")

    # ------------------------------------------------------------ memory

    def register_memory(self, buffer_addr, capacity, location="*") -> int:
        """`location`: "*" or "cpu[:N]" (host memory, or device memory where
        the engine's device runtime finds it), "cuda[:N]" (device memory)."""
        eng = self._ready("register_memory")
        if eng is None:
            return -1
        where = str(location or "*").strip().lower()
        kind, _, index = where.partition(":")
        device = None
        if kind in ("npu", "musa", "hip", "ascend", "maca"):
            log.error("register_memory(%#x): location %r: kvlink reaches CPU and CUDA memory only",
                      buffer_addr or 0, location)
            return -1
        if kind == "cuda":
            if eng.device_runtime is None:
                log.error("register_memory(%#x, %d, %r): this engine has no device runtime for GPU "
                          "memory (kvlink's `device` setting is %r; KVLINK_DEVICE=cuda needs a GPU "
                          "and a kvlink built with CUDA, this one has: %s)", buffer_addr or 0,
                          capacity or 0, location, eng.config.get("device"),
                          _kvlink.device_runtimes())
                return -1
            device = int(index) if index.isdigit() else -1
        try:
            eng.register(int(buffer_addr), int(capacity), device=device)
            return 0
        except (kvlink.Error, TypeError, ValueError, OverflowError) as e:
            log.error("register_memory(%#x, %d, %r): %s", buffer_addr or 0, capacity or 0,
                      location, e)
            if getattr(e, "errc", "") == "overlapping_registration":
                return _ERR_ADDRESS_OVERLAPPED
            return _ERR_INVALID_ARGUMENT

    def unregister_memory(self, buffer_addr, /) -> int:
        eng = self._ready("unregister_memory")
        if eng is None:
            return -1
        seg = eng._core.segment_at(int(buffer_addr))
        if seg is None:
            log.error("unregister_memory(%#x): not registered", buffer_addr)
            return _ERR_ADDRESS_NOT_REGISTERED
        try:
            eng.unregister(seg.id)
            return 0
        except kvlink.Error as e:
            log.error("unregister_memory(%#x): %s", buffer_addr, e)
            return -1

    def batch_register_memory(self, buffer_addresses, capacities, location="*") -> int:
        """All or nothing: a failure unregisters what this call registered and
        gives the failing entry's code (as register_memory)."""
        if len(buffer_addresses) != len(capacities):
            log.error("batch_register_memory: %d addresses, %d capacities",
                      len(buffer_addresses), len(capacities))
            return _ERR_INVALID_ARGUMENT
        done = []
        for addr, cap in zip(buffer_addresses, capacities):
            rc = self.register_memory(addr, cap, location)
            if rc != 0:
                for a in done:
                    self.unregister_memory(a)
                return rc
            done.append(addr)
        return 0

    def batch_unregister_memory(self, buffer_addresses, /) -> int:
        """Unregisters every address it can; the first failure's code."""
        results = [self.unregister_memory(a) for a in buffer_addresses]
        return next((r for r in results if r != 0), 0)

    def allocate_managed_buffer(self, length, /) -> int:
        """A page-aligned, zeroed, registered buffer; 0 on failure."""
        eng = self._ready("allocate_managed_buffer")
        if eng is None or length <= 0:
            return 0
        try:
            addr = _kvlink.map_pages(int(length))
        except kvlink.Error as e:
            log.error("allocate_managed_buffer(%d): %s", length, e)
            return 0
        if self.register_memory(addr, length) != 0:
            _kvlink.unmap_pages(addr, int(length))
            return 0
        with self._lock:
            self._managed[addr] = int(length)
        return addr

    def free_managed_buffer(self, buffer_addr, length, /) -> int:
        with self._lock:
            size = self._managed.pop(int(buffer_addr), None)
        if size is None:
            log.error("free_managed_buffer(%#x): not from allocate_managed_buffer", buffer_addr)
            return -1
        self.unregister_memory(buffer_addr)  # waits until no peer touches it
        _kvlink.unmap_pages(int(buffer_addr), size)
        return 0

    def write_bytes_to_buffer(self, dest_address, src_ptr, length, /) -> int:
        eng = self._ready("write_bytes_to_buffer")
        if eng is None:
            return -1
        data = src_ptr.encode() if isinstance(src_ptr, str) else src_ptr
        try:
            eng._core.write_bytes(int(dest_address), data, int(length))
            return 0
        except kvlink.Error as e:
            log.error("write_bytes_to_buffer: %s", e)
            return -1

    def read_bytes_from_buffer(self, source_address, length, /) -> bytes:
        eng = self._ready("read_bytes_from_buffer", raise_=True)
        return eng._core.read_bytes(int(source_address), int(length))

    def get_first_buffer_address(self, segment_name, /) -> int:
        """The base of the first buffer `segment_name` registered; 0 if none."""
        peer = self._peer(segment_name, "get_first_buffer_address")
        if peer is None:
            return 0
        segs = sorted(peer.segments(), key=lambda s: s.id)
        return segs[0].base if segs else 0

    # --------------------------------------------------------- transfers

    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length,
                            transport_hint="") -> int:
        return self._sync(target_hostname, kvlink.WRITE, buffer, peer_buffer_address, length)

    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length,
                           transport_hint="") -> int:
        return self._sync(target_hostname, kvlink.READ, buffer, peer_buffer_address, length)

    def transfer_sync(self, target_hostname, buffer, peer_buffer_address, length, opcode,
                      notify=None, transport_hint="") -> int:
        return self._sync(target_hostname, int(opcode), buffer, peer_buffer_address, length,
                          notify)

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                  transport_hint="") -> int:
        return self._sync(target_hostname, kvlink.WRITE, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                 transport_hint="") -> int:
        return self._sync(target_hostname, kvlink.READ, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                            opcode, notify=None, transport_hint="") -> int:
        return self._sync(target_hostname, int(opcode), buffers, peer_buffer_addresses, lengths,
                          notify)

    def batch_transfer_async_write(self, target_hostname, buffers, peer_buffer_addresses,
                                   lengths, transport_hint="") -> int:
        """A batch id; 2**64 - 1 for a peer that cannot be reached, 0 for a
        batch refused at submission (Mooncake's values)."""
        return self._async(target_hostname, kvlink.WRITE, buffers, peer_buffer_addresses,
                           lengths, _INVALID_BATCH, 0)

    def batch_transfer_async_read(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                                  transport_hint="") -> int:
        """As batch_transfer_async_write."""
        return self._async(target_hostname, kvlink.READ, buffers, peer_buffer_addresses, lengths,
                           _INVALID_BATCH, 0)

    def batch_transfer_async(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                             opcode, transport_hint="") -> int:
        """As batch_transfer_async_write."""
        return self._async(target_hostname, int(opcode), buffers, peer_buffer_addresses, lengths,
                           _INVALID_BATCH, 0)

    def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length,
                              transport_hint="") -> int:
        """A batch id for transfer_check_status; 2**64 - 1 on any failure
        (Mooncake's (batch_id_t)-1)."""
        return self._async(target_hostname, kvlink.WRITE, buffer, peer_buffer_address, length,
                           _INVALID_BATCH, _INVALID_BATCH)

    def get_batch_transfer_status(self, batch_ids, /) -> int:
        """Waits for every batch; 0 if all succeeded, else -1 (an unknown id counts as failed)."""
        ok = True
        for bid in batch_ids:
            with self._lock:
                op = self._batches.pop(int(bid), None)
            if op is None:
                log.error("get_batch_transfer_status: unknown batch id %s", bid)
                ok = False
                continue
            op.wait()  # bounded by the transfer's deadline and the engine's fence
            ok = self._outcome(op) and ok
        return 0 if ok else -1

    def transfer_check_status(self, batch_id, /) -> int:
        """1 done, 0 in progress, -1 failed or unknown, -2 timed out."""
        with self._lock:
            op = self._batches.get(int(batch_id))
            if op is None:
                return -1
            if not op.done():
                return 0
            del self._batches[int(batch_id)]
        try:
            op.result()
            return 1
        except kvlink.Error as e:
            log.error("transfer %s: %s", batch_id, e)
            return -2 if e.errc == "deadline_exceeded" else -1

    def transfer_write_on_cuda(self, target_hostname, buffer, peer_buffer_address, length,
                               stream_ptr=0, transport_hint="") -> None:
        self._on_cuda("transfer_write_on_cuda", target_hostname, kvlink.WRITE, buffer,
                      peer_buffer_address, length, stream_ptr)

    def transfer_read_on_cuda(self, target_hostname, buffer, peer_buffer_address, length,
                              stream_ptr=0, transport_hint="") -> None:
        self._on_cuda("transfer_read_on_cuda", target_hostname, kvlink.READ, buffer,
                      peer_buffer_address, length, stream_ptr)

    def batch_transfer_write_on_cuda(self, target_hostname, buffers, peer_buffer_addresses,
                                     lengths, stream_ptr=0, transport_hint="") -> None:
        self._on_cuda("batch_transfer_write_on_cuda", target_hostname, kvlink.WRITE, buffers,
                      peer_buffer_addresses, lengths, stream_ptr)

    def batch_transfer_read_on_cuda(self, target_hostname, buffers, peer_buffer_addresses,
                                    lengths, stream_ptr=0, transport_hint="") -> None:
        self._on_cuda("batch_transfer_read_on_cuda", target_hostname, kvlink.READ, buffers,
                      peer_buffer_addresses, lengths, stream_ptr)

    def _on_cuda(self, what, target, op, local, remote, lengths, stream_ptr) -> None:
        """Mooncake runs the transfer as a host function on the stream; here
        the caller waits for the stream's earlier work, then for the transfer:
        later work on the stream sees the bytes either way."""
        eng = self._ready(what, raise_=True)
        if isinstance(local, (list, tuple)) and not len(local) == len(remote) == len(lengths):
            raise RuntimeError(f"kvlink.mooncake: {what}: buffers, peer_buffer_addresses and "
                               "lengths have different size")
        try:
            self._wait_for_stream(int(stream_ptr or 0), eng.device_runtime)
        except Exception as e:  # noqa: BLE001 -- any failure of the CUDA call says why
            log.error("%s: waiting for CUDA stream %#x: %s", what, stream_ptr or 0, e)
            raise RuntimeError(f"kvlink.mooncake: {what}: waiting for CUDA stream "
                               f"{stream_ptr or 0:#x}: {e}") from e
        if self._sync(target, op, local, remote, lengths) != 0:
            raise RuntimeError(f"kvlink.mooncake: {what} with {target} failed (the reason is on "
                               "the 'kvlink.mooncake' logger)")

    @staticmethod
    def _wait_for_stream(stream_ptr: int, runtime: Optional[str]) -> None:
        """Returns once the work queued on CUDA stream `stream_ptr` (0: the
        legacy default stream) is done: through torch where it is loaded,
        else libcudart. Nothing to wait for without CUDA (the emulated
        device copies synchronously)."""
        if runtime != "cuda":
            return
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            stream = (torch.cuda.ExternalStream(stream_ptr) if stream_ptr
                      else torch.cuda.default_stream())
            stream.synchronize()
            return
        import ctypes
        for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"):
            try:
                cudart = ctypes.CDLL(name)
            except OSError:
                continue
            err = cudart.cudaStreamSynchronize(ctypes.c_void_p(stream_ptr))
            if err != 0:
                raise RuntimeError(f"cudaStreamSynchronize: CUDA error {err}")
            return
        raise RuntimeError("neither torch nor libcudart is loaded to wait for the stream with")

    def warmup_efa_segment(self, segment_name) -> int:
        return 0  # no EFA here: nothing to warm up, as in Mooncake's builds without EFA

    # ------------------------------------------------------ notifications

    def get_notifies(self, /) -> List[TransferNotify]:
        eng = self._ready("get_notifies")
        if eng is None:
            return []
        return [TransferNotify(n.id, n.payload.decode("utf-8", "surrogateescape"))
                for n in eng.notifications()]

    def send_probe(self, peer_server_name) -> int:
        """0 when the peer answers a fresh handshake, -1 otherwise."""
        return 0 if self._peer(peer_server_name, "send_probe", fresh=True) is not None else -1

    # ----------------------------------------------------------- helpers

    def _ready(self, what: str, raise_: bool = False) -> Optional[kvlink.Engine]:
        if self._engine is None:
            if raise_:
                raise RuntimeError(f"kvlink.mooncake: {what}: call initialize() first")
            log.error("%s: call initialize() first", what)
        return self._engine

    def _peer(self, name: str, what: str, fresh: bool = False) -> Optional[kvlink.Peer]:
        """The connected peer `name`, connecting (again) when needed; None on failure."""
        eng = self._ready(what)
        if eng is None:
            return None
        key = str(name) if self._by_name else _session(str(name))
        with self._lock:
            peer = self._peers.get(key)
        if peer is not None and peer.connected and not fresh:
            return peer
        try:
            peer = eng.connect(key, timeout=self._connect_limit)
        except kvlink.Error as e:
            log.error("%s: cannot reach %s: %s", what, name, e)
            with self._lock:
                self._peers.pop(key, None)
            return None
        with self._lock:
            self._peers[key] = peer
        return peer

    def _deadline(self, lengths: Any) -> float:
        # Mooncake's bound: MC_TRANSFER_TIMEOUT plus one second per 10^9 bytes.
        try:
            if isinstance(lengths, int):
                total = lengths
            elif hasattr(lengths, "sum"):  # numpy: no Python int per entry
                total = int(lengths.sum())
            else:
                total = sum(lengths)
        except (TypeError, ValueError):
            total = 0
        return self._timeout_s + total / 1e9

    def _submit(self, target: str, op: int, local: Any, remote: Any, lengths: Any,
                notify: Optional[TransferNotify], what: str) -> Optional[_kvlink.Operation]:
        peer = self._peer(target, what)
        if peer is None:
            return None
        try:
            return self._engine.submit(op, peer, local, remote, lengths,
                                       notify=None if notify is None else (notify.name, notify.msg),
                                       deadline=self._deadline(lengths))
        except (kvlink.Error, TypeError, ValueError, OverflowError) as e:
            log.error("%s to %s: %s", what, target, e)
            return None

    def _outcome(self, op: _kvlink.Operation) -> bool:
        try:
            op.result()
            return True
        except kvlink.Error as e:
            log.error("%s", e)
            if e.errc in ("peer_closed", "instance_changed", "unknown_peer"):
                with self._lock:  # reconnect next time
                    self._peers = {k: p for k, p in self._peers.items() if p.connected}
            return False

    def _sync(self, target, op, local, remote, lengths, notify=None) -> int:
        op_ = self._submit(target, op, local, remote, lengths, notify, "transfer")
        return 0 if op_ is not None and self._outcome(op_) else -1

    def _async(self, target, op, local, remote, lengths, unreachable: int, refused: int) -> int:
        if self._peer(target, "async transfer") is None:
            return unreachable
        op_ = self._submit(target, op, local, remote, lengths, None, "async transfer")
        if op_ is None:
            return refused
        bid = next(self._batch_ids)
        with self._lock:
            self._batches[bid] = op_
        return bid


_ALIAS_PTH = "kvlink_mooncake_alias.pth"


def _inert_alias() -> Optional[str]:
    """A folder on sys.path (from PYTHONPATH, say) holding the alias's .pth
    file although it is not a site directory: Python reads .pth files in
    site directories only, so the alias there does nothing."""
    import site
    sites = set()
    for d in list(site.getsitepackages()) + [site.getusersitepackages()]:
        sites.add(os.path.realpath(d))
    for entry in sys.path:
        folder = os.path.realpath(entry or os.curdir)
        if folder not in sites and os.path.isfile(os.path.join(folder, _ALIAS_PTH)):
            return entry or os.curdir
    return None


def _main() -> int:
    """python3 -m kvlink.mooncake: says what `import mooncake.engine` gives here."""
    try:
        import mooncake.engine as m
    except ImportError as e:
        inert = _inert_alias()
        if inert is not None:
            print(f"import mooncake.engine: {e}\n"
                  f"The kvlink alias is installed in {inert} ({_ALIAS_PTH} is there), but that "
                  "folder is not a site directory: Python processes .pth files only in site "
                  "directories, so the alias is not active from PYTHONPATH. Either install it "
                  "into a site directory (pip install ./python/mooncake-alias, or `cmake "
                  "--install` with KVLINK_PYTHON_INSTALL_DIR set to python3 -c \"import sysconfig; "
                  "print(sysconfig.get_path('purelib'))\"), or make that folder one: "
                  f"site.addsitedir({inert!r}) before `import mooncake` (for instance in a "
                  "sitecustomize.py, or python3 -c \"import site; site.addsitedir(...)\"). "
                  "See kvlink's README, \"Python\".")
            return 1
        print(f"import mooncake.engine: {e}\n(no Mooncake, and the kvlink alias is not "
              "installed: see kvlink's README, \"Python\")")
        return 1
    origin = getattr(sys.modules.get("mooncake"), "__kvlink_alias__", False)
    print(f"mooncake.engine -> {'kvlink ' + kvlink.__version__ if origin else 'Mooncake'} "
          f"({getattr(m, '__file__', None) or m.TransferEngine.__module__})")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
