"""Mooncake's `mooncake.store` API over kvlink's store.

`MooncakeDistributedStore` has Mooncake's method names, positional order,
defaults and integer results for the calls below, over kvlink.StoreClient
and a `kvlink-master` (Mooncake's `mooncake_master` role):

    store = MooncakeDistributedStore()
    store.setup("localhost", "P2PHANDSHAKE", 512 << 20, 16 << 20, "tcp", "",
                "127.0.0.1:50051")            # 0, or -1 with the reason logged
    store.put("k", b"v")                      # 0; a re-put of an existing key 0 too
    store.get("k")                            # b"v"; b"" for a missing key
    store.batch_is_exist(["k", "x"])          # [1, 0]

Results are Mooncake's: 0 or a negative code (-200 no space: back off;
-704 not found; -600 bad arguments or a buffer too small; -900 the master
not reachable), the bytes read for get_into/batch_get_into and the
multi-buffer gets, 1/0/-1 for is_exist. The reason of every failure is on
the "kvlink.mooncake.store" logger. Implemented: setup (the 7-positional
form with its keywords, and the dict form), MooncakeConfig (a
MOONCAKE_CONFIG_PATH or SGLANG_HICACHE_MOONCAKE_CONFIG_PATH file, or
MOONCAKE_* variables), close, get_hostname,
health_check, put, get, get_size, put_batch, get_batch, put_parts,
put_from, get_into, batch_put_from, batch_get_into, get_into_ranges (ranged
reads, copied out of one read of each object),
batch_put_from_multi_buffers, batch_get_into_multi_buffers (each piece
moved straight to or from its place in the object), get_buffer and
batch_get_buffer (BufferHandle: the bytes copied
into memory of the call), register_buffer, unregister_buffer, is_exist,
batch_is_exist, remove, batch_remove, remove_all, batch_get_replica_desc
and get_replica_desc (ReplicaDescriptor, ReplicaStatus, MemoryDescriptor,
Descriptor: each replica's owner endpoint, offset in its segment and size,
no read lease taken), SoftPinAction (ENABLE pins), MooncakeHostMemAllocator.
Buffers given to register_buffer may be device memory (a CUDA KV cache, as
vLLM registers it) when the engine has a device runtime (by default CUDA
where the module has it and a GPU is present; KVLINK_DEVICE names one):
put_from, get_into, their batches and the multi-buffer calls move it like
host memory.
setup_dummy (through a kvlink-store-client process that holds the
host's segment; the rank moves bytes with its own engine). Not offered: SSD
offload, tenants other than "default", and ReplicateConfig's
preferred_segment(s), soft_pin_ttl_ms and group_ids, which are accepted
(the first two logged) but not used (kvlink places by segment id).
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import enum
import json
import logging
import mmap
import os
import random
import re
import socket
import threading
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from . import Error, StoreClient, _error

__all__ = ["BufferHandle", "Descriptor", "DiskDescriptor", "MemoryDescriptor", "MooncakeConfig",
           "MooncakeDistributedStore", "MooncakeHostMemAllocator", "ReplicaDescriptor",
           "ReplicaStatus", "ReplicateConfig", "SoftPinAction"]

log = logging.getLogger("kvlink.mooncake.store")

INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
INTERNAL_ERROR = -1

_PORTS = range(12300, 14301)  # where Mooncake's engine picks its port
_RNG = random.SystemRandom()


def _in_use(e: BaseException) -> bool:
    """Whether a StoreClient could not listen because the port is taken."""
    return getattr(e, "errc", None) == "EADDRINUSE" or "already in use" in str(e)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def _size(value: Any) -> int:
    """Bytes of an int or a string like "4GB" (binary units, as Mooncake)."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class SoftPinAction(enum.IntEnum):
    """What a put does with the object's soft pin (Mooncake's SoftPinAction):
    ENABLE pins it, DISABLE does not, PRESERVE keeps what the object had
    (kvlink never rewrites an object, so a new one is not pinned)."""
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ReplicateConfig:
    """How a put places its object (Mooncake's ReplicateConfig)."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.with_soft_pin = False
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms: Optional[int] = None
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: List[str] = []
        self.prefer_alloc_in_same_node = False
        self.group_ids: Optional[List[str]] = None

    def __repr__(self) -> str:
        return (f"ReplicateConfig(replica_num={self.replica_num}, "
                f"with_soft_pin={self.with_soft_pin}, soft_pin_action={self.soft_pin_action!r}, "
                f"with_hard_pin={self.with_hard_pin})")


class ReplicaStatus(enum.IntEnum):
    """A replica's state (Mooncake's ReplicaStatus); kvlink describes
    complete objects only."""
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


@dataclasses.dataclass
class Descriptor:
    """Where a memory replica's bytes are (Mooncake's buffer Descriptor):
    transport_endpoint is its owner's engine address; buffer_address is the
    object's offset in the owner's segment (kvlink addresses segments by
    offset, not by the owner's virtual addresses)."""
    size: int = 0
    buffer_address: int = 0
    transport_endpoint: str = ""


@dataclasses.dataclass
class MemoryDescriptor:
    buffer_descriptor: Descriptor = dataclasses.field(default_factory=Descriptor)


@dataclasses.dataclass
class DiskDescriptor:
    file_path: str = ""
    object_size: int = 0


class ReplicaDescriptor:
    """One replica of an object (Mooncake's ReplicaDescriptor): in memory,
    complete (kvlink has no disk tier yet)."""

    def __init__(self, memory: MemoryDescriptor,
                 status: ReplicaStatus = ReplicaStatus.COMPLETE) -> None:
        self.status = status
        self._memory = memory

    def is_memory_replica(self) -> bool:
        return True

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return False

    def get_memory_descriptor(self) -> MemoryDescriptor:
        return self._memory

    def get_disk_descriptor(self) -> DiskDescriptor:
        raise RuntimeError("not a disk replica: kvlink's replicas are in memory")

    def __repr__(self) -> str:
        d = self._memory.buffer_descriptor
        return (f"<ReplicaDescriptor {self.status.name} memory endpoint={d.transport_endpoint} "
                f"address={d.buffer_address} size={d.size}>")


class MooncakeHostMemAllocator:
    """Page-aligned host memory for buffers to register (Mooncake's
    MooncakeHostMemAllocator): alloc(size) gives an address, free(address)
    returns it (0 on success, -1 for an address it did not give)."""

    def __init__(self) -> None:
        self._blocks: Dict[int, Any] = {}
        self._lock = threading.Lock()

    def alloc(self, size: int) -> int:
        if size <= 0:
            raise ValueError(f"alloc: size must be > 0, not {size}")
        block = mmap.mmap(-1, size)  # anonymous, page-aligned, zeroed
        address = ctypes.addressof(ctypes.c_char.from_buffer(block))
        with self._lock:
            self._blocks[address] = block
        return address

    def free(self, address: int) -> int:
        with self._lock:
            block = self._blocks.pop(address, None)
        if block is None:
            return -1
        try:
            block.close()
        except BufferError:
            # Something still exports the memory (a view): it goes when that does.
            pass
        return 0


def _code(e: BaseException, what: str) -> int:
    """Mooncake's integer for a failure, with the reason logged."""
    log.warning("%s: %s", what, e)
    if isinstance(e, Error):
        if e.errc in ("invalid_argument", "not_registered", "buffer_overflow"):
            return INVALID_PARAMS
        code = getattr(e, "mooncake_code", INTERNAL_ERROR)
        return code if code != 0 else INTERNAL_ERROR
    if isinstance(e, (TypeError, ValueError, OverflowError)):
        return INVALID_PARAMS
    return INTERNAL_ERROR


def _ssd_capacity(path: str) -> int:
    """The SSD tier's budget: $KVLINK_SSD_CAPACITY, else 80 % of the free
    space of the file system `path` is on (its nearest existing parent)."""
    given = os.getenv("KVLINK_SSD_CAPACITY")
    if given:
        return _size(given)
    where = os.path.abspath(path)
    while not os.path.exists(where):
        where = os.path.dirname(where)
    st = os.statvfs(where)
    return st.f_bavail * st.f_frsize * 4 // 5


def _bool(value: Any) -> bool:
    """A boolean as configs write it (True, 1, "true", "off", ...)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    if value is None:
        return False
    text = str(value).strip().lower()
    if text in ("", "false", "0", "no", "off"):
        return False
    if text in ("true", "1", "yes", "on"):
        return True
    raise ValueError(f"not a boolean: {value!r}")


DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200  # 3.125 GiB, Mooncake's MooncakeConfig default
DEFAULT_LOCAL_BUFFER_SIZE = 1 << 30


@dataclasses.dataclass
class MooncakeConfig:
    """Mooncake's client configuration (mooncake.mooncake_config's
    MooncakeConfig): the JSON file that MOONCAKE_CONFIG_PATH names, or the
    MOONCAKE_* variables. Sizes are ints or strings like "4GB" (binary
    units). `dataclasses.asdict(cfg)` is a dict that setup() takes:

        store.setup(dataclasses.asdict(MooncakeConfig.load_from_env()))
    """

    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: Optional[str]
    master_server_address: str
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"

    @staticmethod
    def from_file(file_path: str) -> "MooncakeConfig":
        """Reads the JSON file; local_hostname, metadata_server and
        master_server_address are required (ValueError otherwise)."""
        with open(file_path, encoding="utf-8") as f:
            cfg = json.load(f)
        if not isinstance(cfg, dict):
            raise ValueError(f"{file_path}: not a JSON object")
        for name in ("local_hostname", "metadata_server", "master_server_address"):
            if name not in cfg:
                raise ValueError(f"{file_path}: missing required config field: {name}")
        tenant = cfg.get("tenant_id")
        path = cfg.get("ssd_offload_path")
        return MooncakeConfig(
            local_hostname=str(cfg["local_hostname"]),
            metadata_server=str(cfg["metadata_server"]),
            global_segment_size=_size(cfg.get("global_segment_size",
                                              DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=_size(cfg.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=str(cfg.get("protocol", "tcp")),
            device_name=str(cfg.get("device_name", "") or ""),
            master_server_address=str(cfg["master_server_address"]),
            enable_ssd_offload=_bool(cfg.get("enable_ssd_offload", False)),
            ssd_offload_path="" if path is None else str(path),
            tenant_id="default" if tenant is None else str(tenant))

    @staticmethod
    def load_from_env() -> "MooncakeConfig":
        """MOONCAKE_CONFIG_PATH's file, else SGLang's
        SGLANG_HICACHE_MOONCAKE_CONFIG_PATH's (the same JSON keys), else
        MOONCAKE_MASTER and the other MOONCAKE_* variables (ValueError when
        none is set)."""
        for var in ("MOONCAKE_CONFIG_PATH", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"):
            path = os.getenv(var)
            if path is not None:
                return MooncakeConfig.from_file(path)
        master = os.getenv("MOONCAKE_MASTER")
        if not master:
            raise ValueError("none of MOONCAKE_CONFIG_PATH, SGLANG_HICACHE_MOONCAKE_CONFIG_PATH "
                             "and MOONCAKE_MASTER is set")
        env = os.getenv
        return MooncakeConfig(
            local_hostname=env("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
            metadata_server=env("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
            global_segment_size=_size(env("MOONCAKE_GLOBAL_SEGMENT_SIZE",
                                          str(DEFAULT_GLOBAL_SEGMENT_SIZE))),
            local_buffer_size=_size(env("MOONCAKE_LOCAL_BUFFER_SIZE",
                                        str(DEFAULT_LOCAL_BUFFER_SIZE))),
            protocol=env("MOONCAKE_PROTOCOL", "tcp"),
            device_name=env("MOONCAKE_DEVICE", ""),
            master_server_address=master,
            enable_ssd_offload=_bool(env("MOONCAKE_OFFLOAD_ENABLED", "false")),
            ssd_offload_path=env("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", ""),
            tenant_id=env("MOONCAKE_TENANT_ID", "default"))


# setup()'s keyword for each key of the dict form; the JSON file's spellings
# (device_name, master_server_address) are accepted beside setup()'s.
_DICT_KEYS = {
    "local_hostname": "local_hostname", "metadata_server": "metadata_server",
    "global_segment_size": "global_segment_size", "local_buffer_size": "local_buffer_size",
    "protocol": "protocol", "rdma_devices": "rdma_devices", "device_name": "rdma_devices",
    "master_server_addr": "master_server_addr",
    "master_server_address": "master_server_addr",
    "enable_ssd_offload": "enable_ssd_offload", "ssd_offload_path": "ssd_offload_path",
    "tenant_id": "tenant_id", "enable_client_http_server": "enable_client_http_server",
    "client_http_port": "client_http_port",
}

class BufferHandle(bytearray):
    """An object's bytes as get_buffer/batch_get_buffer give them
    (Mooncake's BufferHandle): the buffer protocol (a bytearray: numpy,
    torch.frombuffer and memoryview read it in place), ptr() its address
    and size() its length, both valid while the handle lives."""

    def ptr(self) -> int:
        if not self:
            return 0
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def size(self) -> int:
        return len(self)


def _ask_holder(address: str, request: Dict[str, Any],
                timeout: float = 5.0) -> Tuple[Optional[Dict[str, Any]], str]:
    """One request to a kvlink-store-client (a JSON line each way): its
    answer (None when it cannot be had) and this side's address of the
    connection (the interface that reaches the holder)."""
    m = re.fullmatch(r"\[?([^\]]*?)\]?:(\d+)", str(address))
    if not m:
        log.error("%r is not host:port", address)
        return None, ""
    try:
        with socket.create_connection((m.group(1), int(m.group(2))), timeout=timeout) as sock:
            local_ip = sock.getsockname()[0]
            sock.sendall((json.dumps(request) + "\n").encode())
            data = b""
            while not data.endswith(b"\n") and len(data) < 65536:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError as e:
        log.error("kvlink-store-client at %s: %s", address, e)
        return None, ""
    try:
        answer = json.loads(data.decode("utf-8", "replace"))
    except ValueError:
        log.error("kvlink-store-client at %s: not a JSON answer: %r", address, data[:200])
        return None, local_ip
    if not isinstance(answer, dict):
        return None, local_ip
    return answer, local_ip


class MooncakeDistributedStore:
    """Mooncake's store client over kvlink (see the module's doc)."""

    def __init__(self) -> None:
        self._store: Optional[StoreClient] = None
        self._holder: Optional[str] = None  # the kvlink-store-client of setup_dummy
        self._lock = threading.Lock()
        # register_buffer's memory: address -> (kvlink segment, size), and
        # the ranges sorted by address (for the multi-buffer batches' checks).
        self._buffers: Dict[int, Tuple[int, int]] = {}
        self._ranges: List[Tuple[int, int]] = []
        self._guess = 1 << 20  # batch_get_buffer's first capacity per key
        self._hostname = ""  # setup's local_hostname, without a port

    # -- life
    def setup(self, local_hostname: Any, metadata_server: Optional[str] = None,
              global_segment_size: Any = 16 << 20, local_buffer_size: Any = 16 << 20,
              protocol: str = "tcp", rdma_devices: str = "",
              master_server_addr: str = "127.0.0.1:50051", engine: Any = None,
              enable_ssd_offload: bool = False, ssd_offload_path: str = "",
              tenant_id: str = "default", enable_client_http_server: bool = False,
              client_http_port: int = 9300) -> int:
        """Connects to the master at master_server_addr ("host:port", or
        "etcd://host:2379[;host:2379]" where masters stand for election:
        the leader of $MC_STORE_CLUSTER_ID's cluster, else
        "mooncake_cluster", followed across failovers) with
        an engine listening on local_hostname's address, and mounts
        global_segment_size bytes (0: none, a pure requester). 0 or -1.

        Also setup(config: dict), Mooncake's dict form: the keys are the
        keywords above (values as ints, bools or strings; sizes like
        "4GB"), with the JSON file's spellings device_name and
        master_server_address too; local_hostname, metadata_server and the
        master are required; other keys are ignored (LMCache passes its
        own). The metadata server is not used: kvlink's master tells the
        clients where each other's memory is. -1, with the reason logged,
        for what kvlink does not do: a redis:// master, a protocol other than
        tcp/rdma, a tenant other than "default", the client HTTP server.

        enable_ssd_offload: kvlink's SSD tier on this client, in
        ssd_offload_path (else $MOONCAKE_OFFLOAD_FILE_STORAGE_PATH; -1
        without either), of $KVLINK_SSD_CAPACITY bytes (a size like "64GB";
        default: 80 % of the free space of that file system when setup
        runs). Objects evicted from this client's segment are kept there
        and read back when they are read again, also after a restart."""
        if isinstance(local_hostname, Mapping):
            if metadata_server is not None:
                log.error("setup: a dict, or the positional form, not both")
                return INTERNAL_ERROR
            args: Dict[str, Any] = {}
            for key, value in local_hostname.items():
                if key in _DICT_KEYS:
                    args[_DICT_KEYS[key]] = value
            for need in ("local_hostname", "metadata_server", "master_server_addr"):
                if need not in args:
                    log.error("setup: the config has no %s", need)
                    return INTERNAL_ERROR
            try:
                for flag in ("enable_ssd_offload", "enable_client_http_server"):
                    if flag in args:
                        args[flag] = _bool(args[flag])
            except ValueError as e:
                log.error("setup: %s", e)
                return INTERNAL_ERROR
            for text in ("local_hostname", "metadata_server", "protocol", "rdma_devices",
                         "master_server_addr", "ssd_offload_path", "tenant_id"):
                if text in args:
                    args[text] = "" if args[text] is None else str(args[text])
            return self.setup(args.pop("local_hostname"), args.pop("metadata_server"), **args)
        if metadata_server is None:
            log.error("setup: metadata_server is required (\"P2PHANDSHAKE\" will do)")
            return INTERNAL_ERROR
        if self._store is not None:
            log.error("setup: already set up")
            return INTERNAL_ERROR
        try:
            segment = _size(global_segment_size)
            _size(local_buffer_size)  # staging is per call in kvlink: checked, not kept
        except ValueError as e:
            log.error("setup: %s", e)
            return INTERNAL_ERROR
        if segment < 0:
            log.error("setup: global_segment_size %d", segment)
            return INTERNAL_ERROR
        if engine is not None:
            log.warning("setup: engine= is not used: kvlink's store client has an engine of "
                        "its own")
        disk_path, disk_capacity = "", 0
        if enable_ssd_offload:
            disk_path = ssd_offload_path or os.getenv("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", "")
            if not disk_path:
                log.error("setup: enable_ssd_offload needs ssd_offload_path (or "
                          "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH)")
                return INTERNAL_ERROR
            try:
                disk_capacity = _ssd_capacity(disk_path)
            except (OSError, ValueError) as e:
                log.error("setup: SSD tier at %s: %s", disk_path, e)
                return INTERNAL_ERROR
        if tenant_id != "default":
            log.error("setup: tenant %r: kvlink's store has one tenant, \"default\"", tenant_id)
            return INTERNAL_ERROR
        if enable_client_http_server:
            log.error("setup: enable_client_http_server: kvlink's client serves no HTTP")
            return INTERNAL_ERROR
        if not isinstance(master_server_addr, str) or (
                "://" in master_server_addr and not master_server_addr.startswith("etcd://")):
            log.error("setup: master %s: kvlink finds its master by host:port, or its elected "
                      "leader through etcd (\"etcd://host:2379[;host:2379]\")",
                      master_server_addr)
            return INTERNAL_ERROR
        if protocol not in ("tcp", "rdma"):
            log.error("setup: protocol %r: kvlink offers tcp and rdma", protocol)
            return INTERNAL_ERROR
        host = str(local_hostname)  # its port, where it has one
        if not host:
            log.error("setup: local_hostname is empty")
            return INTERNAL_ERROR
        if host.count(":") > 1 and not host.startswith("["):
            host = f"[{host}]"  # a bare IPv6 address
        given_port = re.search(r":\d+$", host) is not None
        name = host[:host.rfind(":")] if given_port else host
        # Without a port, one of Mooncake's (12300..14300, where operators
        # open their firewalls for it), a few tries, then any.
        ports = [None] if given_port else _RNG.sample(_PORTS, 8) + [0]
        store = None
        for port in ports:
            listen = host if port is None else f"{name}:{port}"
            try:
                store = StoreClient(master_server_addr, listen=listen, disk_path=disk_path,
                                    disk_capacity=disk_capacity)
                break
            except (Error, TypeError, ValueError) as e:
                if port is None or port == 0 or not _in_use(e):
                    log.error("setup: %s", e)
                    return INTERNAL_ERROR
        try:
            store.connect()
            if segment > 0:
                store.mount(segment)
        except (Error, TypeError, ValueError) as e:
            log.error("setup: %s", e)
            store.close()
            return INTERNAL_ERROR
        self._store = store
        self._hostname = name
        return 0

    def setup_dummy(self, mem_pool_size: Any, local_buffer_size: Any, server_address: str) -> int:
        """Joins the pool through a kvlink-store-client process on this host
        (Mooncake's dummy client and its mooncake_client): asks it at
        server_address ("host:port", 50052 by default) for the master, then
        connects to that master as a client with no segment of its own, so
        the objects this rank puts live in the holder's segment and outlive
        the rank. Bytes move with this rank's engine straight between its
        registered memory and the holder's segment (same-host memory).
        mem_pool_size and local_buffer_size are checked, not kept (kvlink
        stages per call). 0 or -1, with the reason logged."""
        if self._store is not None:
            log.error("setup_dummy: already set up")
            return INTERNAL_ERROR
        try:
            _size(mem_pool_size)
            _size(local_buffer_size)
        except ValueError as e:
            log.error("setup_dummy: %s", e)
            return INTERNAL_ERROR
        hello, local_ip = _ask_holder(server_address, {"op": "hello", "version": 1})
        if hello is None or not hello.get("ok") or hello.get("version") != 1 or \
                not isinstance(hello.get("master"), str):
            log.error("setup_dummy: %s did not answer as a kvlink-store-client: %s",
                      server_address, hello)
            return INTERNAL_ERROR
        try:
            store = StoreClient(hello["master"], listen=f"{local_ip}:0")
            store.connect()
        except (Error, TypeError, ValueError) as e:
            log.error("setup_dummy: the master %s: %s", hello["master"], e)
            if "store" in locals():
                store.close()
            return INTERNAL_ERROR
        self._store = store
        self._holder = server_address
        return 0

    def close(self) -> int:
        if self._store is not None:
            self._store.close()
            self._store = None
        self._holder = None
        with self._lock:
            self._buffers.clear()
            self._ranges = []
        return 0

    def get_hostname(self) -> str:
        """local_hostname as setup was given it, with the port the engine
        listens on ("localhost:12345"), as Mooncake gives it; "" before
        setup."""
        if self._store is None:
            return ""
        address = self._store.local_address
        port = address[address.rfind(":") + 1:]
        return f"{self._hostname}:{port}" if self._hostname else address

    def health_check(self) -> int:
        """0 when the master answers (and, after setup_dummy, the holder
        process does), -1 otherwise."""
        try:
            self._s().stats()
        except Exception as e:  # noqa: BLE001 - every failure is one answer here
            _code(e, "health_check")
            return INTERNAL_ERROR
        if self._holder is not None:
            answer, _ = _ask_holder(self._holder, {"op": "health"})
            if answer is None or not answer.get("ok"):
                log.warning("health_check: the kvlink-store-client at %s: %s", self._holder,
                            answer)
                return INTERNAL_ERROR
        return 0

    def _s(self) -> StoreClient:
        if self._store is None:
            raise _error("invalid_argument", "the store is not set up: call setup() first")
        return self._store

    @staticmethod
    def _placement(config: Optional[ReplicateConfig]) -> Dict[str, Any]:
        if config is None:
            return {}
        if config.preferred_segment or config.preferred_segments:
            log.warning("ReplicateConfig.preferred_segment(s) is not used by kvlink")
        if config.soft_pin_ttl_ms is not None:
            log.warning("ReplicateConfig.soft_pin_ttl_ms is not used by kvlink (the master's "
                        "store_soft_pin_ttl applies)")
        soft = bool(config.with_soft_pin) or config.soft_pin_action == SoftPinAction.ENABLE
        return {"replicas": int(config.replica_num), "soft_pin": soft,
                "hard_pin": bool(config.with_hard_pin)}

    @staticmethod
    def _put_code(code: int) -> int:
        # Mooncake: putting a key that exists is a success (the object is there).
        return 0 if code == OBJECT_ALREADY_EXISTS else code

    # -- puts
    def put(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        return self.put_batch([key], [value], config)

    def put_parts(self, key: str, *parts: Any, config: Optional[ReplicateConfig] = None) -> int:
        try:
            value = b"".join(memoryview(p).cast("B") for p in parts)
        except TypeError as e:
            return _code(e, f"put_parts '{key}'")
        return self.put(key, value, config)

    def put_batch(self, keys: List[str], values: List[Any],
                  config: Optional[ReplicateConfig] = None) -> int:
        """0, or the first key's failure."""
        try:
            codes = self._s().put_batch(keys, values, **self._placement(config))
        except Exception as e:  # noqa: BLE001
            return _code(e, "put_batch")
        for c in codes:
            if self._put_code(c) != 0:
                return c
        return 0

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: Optional[ReplicateConfig] = None) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(self, keys: List[str], buffer_ptrs: List[int], sizes: List[int],
                       config: Optional[ReplicateConfig] = None) -> List[int]:
        try:
            codes = self._s().put_batch(keys, addresses=buffer_ptrs, sizes=sizes,
                                        **self._placement(config))
        except Exception as e:  # noqa: BLE001
            return [_code(e, "batch_put_from")] * len(keys)
        return [self._put_code(c) for c in codes]

    # -- gets
    def get(self, key: str) -> bytes:
        """The object's bytes; b"" when it is missing or the get failed."""
        try:
            return self._s().get(key)
        except Exception as e:  # noqa: BLE001
            _code(e, f"get '{key}'")
            return b""

    def get_batch(self, keys: List[str]) -> List[bytes]:
        return [self.get(k) for k in keys]

    def get_buffer(self, key: str) -> Optional[BufferHandle]:
        """The object's bytes in a BufferHandle; None when it is missing or
        the get failed (the reason on the logger)."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: List[str]) -> List[Optional[BufferHandle]]:
        """One BufferHandle per key, in input order, None for a key that is
        missing or failed. One batched get into buffers as big as the
        biggest object the last call saw (at most 256 MiB for the batch);
        the keys whose objects are bigger are read once more, each into a
        buffer of its size (get_size). Copies: the bytes land in memory
        this call allocates, not in the pool's."""
        try:
            store = self._s()
            keys = list(keys)
            if not all(isinstance(k, str) for k in keys):
                raise TypeError("batch_get_buffer: keys must be strings")
        except Exception as e:  # noqa: BLE001
            _code(e, "batch_get_buffer")
            return [None] * (len(keys) if isinstance(keys, list) else 0)
        if not keys:
            return []
        # At most 256 MiB of first guesses per call.
        guess = max(4096, min(self._guess, (256 << 20) // len(keys)))
        out: List[Optional[BufferHandle]] = [None] * len(keys)
        handles = [BufferHandle(guess) for _ in keys]
        try:
            got = store.get_batch(keys, handles)
        except Exception as e:  # noqa: BLE001
            _code(e, "batch_get_buffer")
            return out
        again = []
        for i, n in enumerate(got):
            if n >= 0:
                del handles[i][n:]
                out[i] = handles[i]
            elif n == -10:  # bigger than the guess
                again.append(i)
            else:
                log.warning("batch_get_buffer '%s': %d", keys[i], n)
        for i in again:
            size = self.get_size(keys[i])
            if size < 0:
                continue
            handle = BufferHandle(size)
            try:
                n = store.get_batch([keys[i]], [handle])[0]
            except Exception as e:  # noqa: BLE001
                _code(e, f"batch_get_buffer '{keys[i]}'")
                continue
            if n >= 0:
                del handle[n:]
                out[i] = handle
            else:
                log.warning("batch_get_buffer '%s': %d", keys[i], n)
        sizes = [len(h) for h in out if h is not None]
        if sizes:
            self._guess = min(max(max(sizes), 4096), 64 << 20)
        return out

    def get_size(self, key: str) -> int:
        try:
            return self._s()._core.get_size(key)
        except Exception as e:  # noqa: BLE001
            return _code(e, f"get_size '{key}'")

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: List[str], buffer_ptrs: List[int],
                       sizes: List[int]) -> List[int]:
        """The bytes read per key, or a negative code (-600: the buffer is
        smaller than the object, or not registered)."""
        try:
            got = self._s().get_batch(keys, addresses=buffer_ptrs, capacities=sizes)
        except Exception as e:  # noqa: BLE001
            return [_code(e, "batch_get_into")] * len(keys)
        return [INVALID_PARAMS if g == -10 else g for g in got]

    def get_into_ranges(self, buffer_ptrs: List[int], all_keys: List[List[str]],
                        all_dst_offsets: List[List[List[int]]],
                        all_src_offsets: List[List[List[int]]],
                        all_sizes: List[List[List[int]]]) -> List[List[List[int]]]:
        """Mooncake's ranged reads: for buffer b, its keys' ranges r: the
        all_sizes[b][k][r] bytes at all_src_offsets[b][k][r] of object
        all_keys[b][k] are copied to buffer_ptrs[b] + all_dst_offsets[b][k][r].
        Per buffer, per key, per range: the bytes copied or a code (-704
        the object is missing; -600 a range outside the object, outside
        the memory given to register_buffer, or negative); a key whose
        three lists differ in length gets [-600]; a key with no ranges [].
        Outer lists of different lengths: [] and the reason logged. Each
        object is read once (into memory of the call) and copied out."""
        try:
            buffers = [int(p) for p in buffer_ptrs]
            groups = list(zip(all_keys, all_dst_offsets, all_src_offsets, all_sizes,
                              strict=True))
            if len(groups) != len(buffers):
                raise ValueError("buffer_ptrs and the key lists differ in length")
            plans = []
            for keys, dsts, srcs, sizes in groups:
                plans.append([(str(k), d, s, n) for k, d, s, n in
                              zip(keys, dsts, srcs, sizes, strict=True)])
        except (TypeError, ValueError) as e:
            log.error("get_into_ranges: %s", e)
            return []
        wanted = sorted({k for plan in plans for k, _, _, _ in plan})
        objects = dict(zip(wanted, self.batch_get_buffer(wanted))) if wanted else {}
        with self._lock:
            ranges = list(self._ranges)
        starts = [r[0] for r in ranges]
        out: List[List[List[int]]] = []
        for base, plan in zip(buffers, plans):
            per_key: List[List[int]] = []
            for key, dsts, srcs, sizes in plan:
                try:
                    triples = [(int(d), int(s), int(n)) for d, s, n in
                               zip(dsts, srcs, sizes, strict=True)]
                except (TypeError, ValueError):
                    log.warning("get_into_ranges '%s': its range lists differ", key)
                    per_key.append([INVALID_PARAMS])
                    continue
                obj = objects.get(key)
                if obj is None:
                    per_key.append([OBJECT_NOT_FOUND] * len(triples))
                    continue
                results = []
                for dst, src, n in triples:
                    at = base + dst
                    if dst < 0 or src < 0 or n < 0 or src + n > len(obj) or \
                            self._pieces(ranges, starts, [at], [n]) is None:
                        log.warning("get_into_ranges '%s': %d bytes from %d to %#x+%d: "
                                    "outside the object (%d bytes) or registered memory",
                                    key, n, src, base, dst, len(obj))
                        results.append(INVALID_PARAMS)
                        continue
                    if n > 0:
                        ctypes.memmove(at, obj.ptr() + src, n)
                    results.append(n)
                per_key.append(results)
            out.append(per_key)
        return out

    # -- memory
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        try:
            seg = self._s()._core.register(buffer_ptr, size)
        except Exception as e:  # noqa: BLE001
            return _code(e, "register_buffer")
        with self._lock:
            self._buffers[buffer_ptr] = (seg, size)
            self._ranges = sorted((a, a + n) for a, (_, n) in self._buffers.items())
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        with self._lock:
            entry = self._buffers.pop(buffer_ptr, None)
            self._ranges = sorted((a, a + n) for a, (_, n) in self._buffers.items())
        if entry is None:
            log.warning("unregister_buffer: %#x was not registered", buffer_ptr)
            return INVALID_PARAMS
        try:
            self._s().unregister(entry[0])
            return 0
        except Exception as e:  # noqa: BLE001
            return _code(e, "unregister_buffer")

    @staticmethod
    def _pieces(ranges: List[Tuple[int, int]], starts: List[int], ptrs: Any,
                sizes: Any) -> Optional[List[Tuple[int, int]]]:
        """(address, length) of one key's pieces when every piece lies
        inside memory given to register_buffer; None otherwise."""
        if isinstance(ptrs, (str, bytes)) or isinstance(sizes, (str, bytes)):
            return None
        try:
            pieces = [(int(a), int(n)) for a, n in zip(ptrs, sizes, strict=True)]
        except (TypeError, ValueError):
            return None
        for addr, n in pieces:
            if addr <= 0 or n < 0:
                return None
            i = bisect.bisect_right(starts, addr) - 1
            if i >= 0 and addr + n <= ranges[i][1]:
                continue
            # Overlapping registrations: any one range holding the piece will do.
            if not any(lo <= addr and addr + n <= hi for lo, hi in ranges):
                return None
        return pieces

    def _plan(self, what: str, keys: Sequence[str], all_buffer_ptrs: Any,
              all_sizes: Any) -> Tuple[List[int], List[Tuple[int, List[Tuple[int, int]]]]]:
        """Per-key results so far (-600 for a key whose pieces are not all
        inside registered memory, or whose lists differ in length) and the
        keys to move: (index, pieces)."""
        if isinstance(keys, (str, bytes)):
            raise TypeError(f"{what}: keys must be a list of strings")
        keys = list(keys)
        if len(all_buffer_ptrs) != len(keys) or len(all_sizes) != len(keys):
            raise ValueError(f"{what}: {len(keys)} keys, {len(all_buffer_ptrs)} pointer lists, "
                             f"{len(all_sizes)} size lists")
        with self._lock:
            ranges = list(self._ranges)
        starts = [r[0] for r in ranges]
        results = [0] * len(keys)
        todo = []
        for i in range(len(keys)):
            pieces = self._pieces(ranges, starts, all_buffer_ptrs[i], all_sizes[i])
            if pieces is None or not isinstance(keys[i], str):
                log.warning("%s: key %d (%r): its buffers are not all inside memory given "
                            "to register_buffer, or its lists differ in length", what, i,
                            keys[i])
                results[i] = INVALID_PARAMS
            else:
                todo.append((i, pieces))
        return results, todo

    # -- multi-buffer batches (vLLM's MooncakeStoreConnector)
    @staticmethod
    def _flat(todo: List[Tuple[int, List[Tuple[int, int]]]]) -> Tuple[List[int], List[int],
                                                                       List[int]]:
        """The flat (addresses, sizes, counts) columns of put_pieces/get_pieces."""
        addresses: List[int] = []
        sizes: List[int] = []
        counts: List[int] = []
        for _, pieces in todo:
            counts.append(len(pieces))
            for addr, n in pieces:
                addresses.append(addr)
                sizes.append(n)
        return addresses, sizes, counts

    def batch_put_from_multi_buffers(self, keys: List[str], all_buffer_ptrs: List[List[int]],
                                     all_sizes: List[List[int]],
                                     config: Optional[ReplicateConfig] = None) -> List[int]:
        """Puts, under keys[i], one object made of the pieces
        all_buffer_ptrs[i][j] (all_sizes[i][j] bytes each), in that order:
        vLLM's per-layer K/V pieces of one block gathered into one object.
        One int per key, in input order: 0, or -600 (the pieces are not all
        inside memory given to register_buffer, or its two lists differ in
        length, or they hold no bytes: nothing is put for that key),
        -200 (no space), ... A whole batch of -600 when the three lists
        differ in length.

        Each piece is written straight into its place in the object's
        replicas (host or device memory, no gathering copy)."""
        try:
            store = self._s()
            results, todo = self._plan("batch_put_from_multi_buffers", keys,
                                       all_buffer_ptrs, all_sizes)
            placement = self._placement(config)
        except Exception as e:  # noqa: BLE001
            return [_code(e, "batch_put_from_multi_buffers")] * len(keys)
        for i, pieces in list(todo):
            if not any(n for _, n in pieces):
                log.warning("batch_put_from_multi_buffers: '%s': no bytes", keys[i])
                results[i] = INVALID_PARAMS
        todo = [t for t in todo if results[t[0]] == 0]
        if not todo:
            return results
        addresses, sizes, counts = self._flat(todo)
        try:
            codes = store.put_pieces([keys[i] for i, _ in todo], addresses, sizes, counts,
                                     **placement)
        except Exception as e:  # noqa: BLE001
            codes = [_code(e, "batch_put_from_multi_buffers")] * len(todo)
        for (i, _), c in zip(todo, codes):
            results[i] = self._put_code(c)
        return results

    def batch_get_into_multi_buffers(self, keys: List[str], all_buffer_ptrs: List[List[int]],
                                     all_sizes: List[List[int]],
                                     prefer_alloc_in_same_node: bool = False) -> List[int]:
        """Reads keys[i] and scatters its bytes over the pieces
        all_buffer_ptrs[i][j] (all_sizes[i][j] bytes each), in order, the
        last one filled only as far as the object goes: vLLM's load of one
        block's K/V pieces into other block ids. One int per key, in input
        order: the object's size, or -600 (the pieces are not all inside
        memory given to register_buffer, or hold fewer bytes than the
        object: nothing is written for that key), -704 (not found), ...
        A whole batch of -600 when the three lists differ in length.

        Each piece is read straight from the replica (host or device
        memory, no staging copy). prefer_alloc_in_same_node is accepted and
        has no effect: kvlink's client reads its own segment's replica
        first, then one on this host, then the first."""
        try:
            store = self._s()
            results, todo = self._plan("batch_get_into_multi_buffers", keys,
                                       all_buffer_ptrs, all_sizes)
        except Exception as e:  # noqa: BLE001
            return [_code(e, "batch_get_into_multi_buffers")] * len(keys)
        if not todo:
            return results
        addresses, sizes, counts = self._flat(todo)
        try:
            got = store.get_pieces([keys[i] for i, _ in todo], addresses, sizes, counts)
        except Exception as e:  # noqa: BLE001
            got = [_code(e, "batch_get_into_multi_buffers")] * len(todo)
        for (i, _), n in zip(todo, got):
            results[i] = INVALID_PARAMS if n == -10 else n
        return results

    # -- exists and remove
    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: List[str]) -> List[int]:
        """1 there, 0 not, -1 an error, per key."""
        try:
            return [r if r >= 0 else -1 for r in self._s().exists_batch(keys)]
        except Exception as e:  # noqa: BLE001
            _code(e, "batch_is_exist")
            return [-1] * len(keys)

    # -- where objects are
    def batch_get_replica_desc(self, keys: List[str]) -> Dict[str, List[ReplicaDescriptor]]:
        """The replicas of each key that has a complete object (keys without
        one are left out), without reading them and without a read lease."""
        try:
            described = self._s().describe_batch(keys)
        except Exception as e:  # noqa: BLE001 (Mooncake returns, never raises)
            _code(e, "batch_get_replica_desc")
            return {}
        out: Dict[str, List[ReplicaDescriptor]] = {}
        for key, d in zip(keys, described):
            if d["code"] != 0:
                continue
            out[key] = [ReplicaDescriptor(MemoryDescriptor(
                Descriptor(d["size"], r["offset"], r["address"]))) for r in d["replicas"]]
        return out

    def get_replica_desc(self, key: str) -> List[ReplicaDescriptor]:
        """batch_get_replica_desc for one key: [] when it has no object."""
        return self.batch_get_replica_desc([key]).get(key, [])

    def remove(self, key: str, force: bool = False) -> int:
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: List[str], force: bool = False) -> List[int]:
        try:
            return self._s().remove_batch(keys, force=force)
        except Exception as e:  # noqa: BLE001
            return [_code(e, "batch_remove")] * len(keys)

    def remove_all(self, force: bool = False) -> int:
        """How many objects went, or a negative code."""
        try:
            return self._s().remove_all(force=force)
        except Exception as e:  # noqa: BLE001
            return _code(e, "remove_all")
