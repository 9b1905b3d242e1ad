"""Mooncake's `mooncake.store` API over kvlink's store (a start).

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
not reachable), the bytes read for get_into/batch_get_into, 1/0/-1 for
is_exist. The reason of every failure is on the "kvlink.mooncake.store"
logger. Implemented: setup (the 7-positional form), close, get_hostname,
health_check, put, get, get_size, put_batch, get_batch, put_parts,
put_from, get_into, batch_put_from, batch_get_into, register_buffer,
unregister_buffer, is_exist, batch_is_exist, remove, batch_remove,
remove_all. Not yet: setup_dummy, the dict form of setup, the
multi-buffer batches, buffers handles, replica descriptors, and
ReplicateConfig.preferred_segment(s), which is accepted and logged but
not used (kvlink places by segment id).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Dict, List, Optional

from . import Error, StoreClient, _error

__all__ = ["MooncakeDistributedStore", "ReplicateConfig"]

log = logging.getLogger("kvlink.mooncake.store")

INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
INTERNAL_ERROR = -1

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


class ReplicateConfig:
    """How a put places its object (Mooncake's ReplicateConfig)."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: List[str] = []
        self.prefer_alloc_in_same_node = False

    def __repr__(self) -> str:
        return (f"ReplicateConfig(replica_num={self.replica_num}, "
                f"with_soft_pin={self.with_soft_pin}, with_hard_pin={self.with_hard_pin})")


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


class MooncakeDistributedStore:
    """Mooncake's store client over kvlink (see the module's doc)."""

    def __init__(self) -> None:
        self._store: Optional[StoreClient] = None
        self._buffers: Dict[int, int] = {}  # address -> kvlink segment of register_buffer

    # -- life
    def setup(self, local_hostname: str, metadata_server: str,
              global_segment_size: Any = 16 << 20, local_buffer_size: Any = 16 << 20,
              protocol: str = "tcp", rdma_devices: str = "",
              master_server_addr: str = "127.0.0.1:50051", engine: Any = None) -> int:
        """Connects to the master at master_server_addr ("host:port") with
        an engine listening on local_hostname's address, and mounts
        global_segment_size bytes (0: none, a pure requester). 0 or -1."""
        if self._store is not None:
            log.error("setup: already set up")
            return INTERNAL_ERROR
        try:
            segment = _size(global_segment_size)
            _size(local_buffer_size)  # staging is per call in kvlink: checked, not kept
        except ValueError as e:
            log.error("setup: %s", e)
            return INTERNAL_ERROR
        if engine is not None:
            log.warning("setup: engine= is not used: kvlink's store client has an engine of "
                        "its own")
        if master_server_addr.startswith("etcd://"):
            log.error("setup: master %s: kvlink finds its master by host:port only",
                      master_server_addr)
            return INTERNAL_ERROR
        if protocol not in ("tcp", "rdma"):
            log.error("setup: protocol %r: kvlink offers tcp and rdma", protocol)
            return INTERNAL_ERROR
        host = local_hostname  # its port, where it has one; any otherwise
        if host.count(":") > 1 and not host.startswith("["):
            host = f"[{host}]:0"  # a bare IPv6 address
        elif not re.search(r":\d+$", host):
            host = f"{host}:0"
        try:
            store = StoreClient(master_server_addr, listen=host)
            store.connect()
            if segment > 0:
                store.mount(segment)
        except (Error, TypeError, ValueError) as e:
            log.error("setup: %s", e)
            if "store" in locals():
                store.close()
            return INTERNAL_ERROR
        self._store = store
        return 0

    def close(self) -> int:
        if self._store is not None:
            self._store.close()
            self._store = None
        self._buffers.clear()
        return 0

    def get_hostname(self) -> str:
        return self._s().local_address if self._store is not None else ""

    def health_check(self) -> int:
        """0 when the master answers, -1 otherwise."""
        try:
            self._s().stats()
            return 0
        except Exception as e:  # noqa: BLE001 - every failure is one answer here
            _code(e, "health_check")
            return INTERNAL_ERROR

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
        return {"replicas": int(config.replica_num), "soft_pin": bool(config.with_soft_pin),
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

    # -- memory
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        try:
            self._buffers[buffer_ptr] = self._s()._core.register(buffer_ptr, size)
            return 0
        except Exception as e:  # noqa: BLE001
            return _code(e, "register_buffer")

    def unregister_buffer(self, buffer_ptr: int) -> int:
        seg = self._buffers.pop(buffer_ptr, None)
        if seg is None:
            log.warning("unregister_buffer: %#x was not registered", buffer_ptr)
            return INVALID_PARAMS
        try:
            self._s().unregister(seg)
            return 0
        except Exception as e:  # noqa: BLE001
            return _code(e, "unregister_buffer")

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
