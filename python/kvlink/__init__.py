"""kvlink: moves KV cache between LLM serving processes, from Python.

    import numpy as np, kvlink

    eng = kvlink.Engine(listen="127.0.0.1:0")          # settings: kvlink.config_table()
    kv = np.zeros(1 << 20, np.uint8)
    eng.register(kv)                                   # any writable buffer, a torch tensor, or (address, length)
    eng.register(gpu_kv)                               # device memory: a CUDA tensor, __cuda_array_interface__, DLPack
    peer = eng.connect("127.0.0.1:17001")              # the peer's local_address
    seg = peer.segments()[0]
    eng.write(peer, kvlink.address_of(kv), seg.base, kv.nbytes)       # by the peer's address
    eng.write(peer, addrs, offsets, 4096, segment=seg.id)             # by (segment, offset); arrays
    result = await eng.awrite(peer, addrs, offsets, 4096, segment=seg.id)   # from asyncio

A batch is columns: local addresses, remote addresses (or offsets with
`segment=`), lengths; each an int (the same for every entry), a list of ints
or a 1-D numpy array of 8-byte integers (read in place: cheap for 10^5
entries). Every failure raises kvlink.Error, whose `errc` is the error's name
("not_registered", "deadline_exceeded", ...). Blocking calls release the GIL;
an Engine may be used from many threads at once; a completed transfer is in
the destination's memory (WRITE: placed and acknowledged by the peer).

Device (GPU) memory: with a device runtime (setting `device`, KVLINK_DEVICE:
"auto" = CUDA where this build has it and a GPU is present; "emulated" = a
CPU-only stand-in for tests and CI), register() takes torch CUDA tensors and
any object with `__cuda_array_interface__` or a CUDA `__dlpack_device__`, and
plain (address, length) of device memory; transfers move it through the
device's copy engine (the CPU never touches it). kvlink.DeviceBuffer is device
memory of a runtime for tests and CI (no GPU needed with runtime="emulated").
"""

from __future__ import annotations

import asyncio
import atexit
import datetime
import functools
import json
import threading
import weakref
from typing import Any, Dict, List, Optional, Union

from . import _kvlink

__all__ = [
    "Engine", "Error", "Peer", "Notification", "TransferResult", "SegmentInfo", "Operation",
    "DeviceBuffer", "StoreClient", "READ", "WRITE", "address_of", "config_table", "make_config", "describe", "__version__",
]

__version__: str = _kvlink.__version__
Error = _kvlink.Error
Peer = _kvlink.Peer
Notification = _kvlink.Notification
TransferResult = _kvlink.TransferResult
SegmentInfo = _kvlink.SegmentInfo
Operation = _kvlink.Operation
# Device memory of a runtime ("emulated": no GPU needed), filled and read only
# through its copy engine: DeviceBuffer(nbytes, device=0, runtime="emulated")
# with .ptr, .nbytes, .write(offset, data), .read(offset, n) and
# __cuda_array_interface__. A test and CI aid, not an allocator for serving.
DeviceBuffer = _kvlink.DeviceBuffer

READ = 0   # remote -> local
WRITE = 1  # local -> remote


def _error(errc: str, text: str) -> Error:
    """A kvlink.Error raised by the Python layer, shaped like the C++ ones."""
    err = Error(f"{text} [{errc}]")
    err.errc, err.value, err.category, err.message, err.context = errc, 0, "kvlink", text, ""
    err.mooncake_code = -1  # as for every error outside the store's category
    return err


# ------------------------------------------------------------------ config

def config_table() -> List[Dict[str, Any]]:
    """Every setting: name (the keyword), env (KVLINK_*), unit, doc, component, default."""
    return json.loads(_kvlink.config_table_json())


def _ms(value: Any) -> Any:
    if isinstance(value, datetime.timedelta):
        return int(value.total_seconds() * 1000)
    return value


def make_config(config: Optional[Dict[str, Any]] = None, *, use_env: bool = True,
                **settings: Any) -> Dict[str, Any]:
    """A complete, validated settings dict: defaults, then KVLINK_* variables
    (use_env), then `config`, then `settings`. Sizes take ints or "4MiB";
    durations ints (ms), "250ms" or a timedelta. Raises kvlink.Error
    (invalid_argument) naming the setting and the rule."""
    merged = dict(config or {})
    merged.update(settings)
    text = json.dumps({k: _ms(v) for k, v in merged.items()})
    return json.loads(_kvlink.normalize_config(text, use_env))


def describe(config: Optional[Dict[str, Any]] = None, **settings: Any) -> str:
    """The settings as a table (name, value, unit, env var, doc); secrets hidden."""
    return _kvlink.describe_config(json.dumps(make_config(config, use_env=False, **settings)))


# --------------------------------------------------------------- memory

def address_of(obj: Any) -> int:
    """The address of a contiguous buffer (numpy array, bytearray, ...), a
    torch tensor (data_ptr()) or device memory (__cuda_array_interface__).
    Keep `obj` alive while the address is used."""
    if hasattr(obj, "data_ptr"):
        return int(obj.data_ptr())
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0])
    return _kvlink.buffer_address(obj, False)[0]


_DLPACK_CPU = 1
_DLPACK_CUDA = 2
_DLPACK_CUDA_HOST = 3      # pinned host memory
_DLPACK_CUDA_MANAGED = 13  # managed memory: the CPU may touch it (host to kvlink)


def _what(obj: Any) -> str:
    return type(obj).__name__


def _dlpack_device(obj: Any) -> Optional[tuple]:
    fn = getattr(obj, "__dlpack_device__", None)
    if fn is None:
        return None
    try:
        kind, index = fn()
        return int(kind), int(index)
    except Exception:  # a malformed exporter: treat as none
        return None


def _cuda_array(obj: Any, cai: Any) -> tuple:
    """(address, bytes) of a __cuda_array_interface__ (version 0-3);
    contiguous arrays only, kvlink registers one address range."""
    try:
        ptr, readonly = cai["data"]
        shape = tuple(int(d) for d in cai["shape"])
        typestr = str(cai["typestr"])
        itemsize = int(typestr[2:])
        strides = cai.get("strides")
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise _error("invalid_argument",
                     f"register: {_what(obj)}.__cuda_array_interface__ is malformed ({e!r})")
    if cai.get("mask") is not None:
        raise _error("invalid_argument",
                     f"register: {_what(obj)} is a masked device array; kvlink registers "
                     "plain memory")
    if readonly:
        raise _error("invalid_argument",
                     f"register: {_what(obj)} is read-only (its __cuda_array_interface__ says "
                     "so); registered memory may be written by transfers")
    nbytes = itemsize
    for d in shape:
        nbytes *= d
    if strides is not None:
        # C order; the stride of a dimension of length 1 does not matter.
        expected = itemsize
        for d, st in zip(reversed(shape), reversed(tuple(int(x) for x in strides))):
            if d != 1 and st != expected:
                raise _error("invalid_argument",
                             f"register: {_what(obj)} is not C-contiguous (shape {shape}, "
                             f"strides {tuple(strides)}, typestr {typestr!r}); register a "
                             "contiguous array or its base allocation")
            expected *= d
    return int(ptr or 0), nbytes


def _device_memory_of(obj: Any) -> Optional[tuple]:
    """(address, bytes, device) of device memory: a torch CUDA tensor, an
    object with __cuda_array_interface__ or a CUDA DLPack object; None for
    anything else. `device` is -1 where the object does not say."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # a torch tensor
        if not getattr(obj, "is_cuda", False):
            return None
        # The tensor's storage from data_ptr() on (a view's too): vLLM and
        # SGLang address KV blocks inside it.
        addr = int(obj.data_ptr())
        storage = obj.untyped_storage() if hasattr(obj, "untyped_storage") else None
        if storage is not None:
            size = int(storage.data_ptr()) + int(storage.nbytes()) - addr
        else:
            size = int(obj.numel() * obj.element_size())
        index = getattr(obj.device, "index", None)
        return addr, size, -1 if index is None else int(index)
    dl = _dlpack_device(obj)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        if dl is not None and dl[0] in (_DLPACK_CPU, _DLPACK_CUDA_HOST, _DLPACK_CUDA_MANAGED):
            return None  # memory the CPU may touch: registered as host memory
        addr, size = _cuda_array(obj, cai)
        return addr, size, dl[1] if dl is not None and dl[0] == _DLPACK_CUDA else -1
    if dl is not None and dl[0] == _DLPACK_CUDA:
        if hasattr(obj, "data_ptr") and hasattr(obj, "nbytes"):
            return int(obj.data_ptr()), int(obj.nbytes), dl[1]
        raise _error("invalid_argument",
                     f"register: {_what(obj)} is CUDA memory (DLPack device {dl}) without "
                     "__cuda_array_interface__ or data_ptr()/nbytes to find its address; "
                     "register (address, length) instead")
    return None


def _memory_of(obj: Any) -> tuple:
    """(address, bytes, pin, device) of something to register; `pin` keeps it
    alive; `device` is None for host memory, else the device (-1: unknown)."""
    dev = _device_memory_of(obj)
    if dev is not None:
        addr, size, index = dev
        return addr, size, obj, index
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # a torch tensor
        if str(getattr(obj, "device", "cpu")) != "cpu":
            raise _error("invalid_argument",
                         f"register: a tensor on {obj.device}: kvlink reaches CPU and CUDA "
                         "memory")
        if not obj.is_contiguous():
            raise _error("invalid_argument", "register: the tensor is not contiguous")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), obj, None
    dl = _dlpack_device(obj)
    if dl is not None and dl[0] not in (_DLPACK_CPU, _DLPACK_CUDA_HOST, _DLPACK_CUDA_MANAGED):
        raise _error("invalid_argument",
                     f"register: {_what(obj)} lives on DLPack device {dl}: kvlink reaches CPU "
                     "and CUDA memory")
    view = memoryview(obj)  # pins the exporter's memory while registered
    addr, length = _kvlink.buffer_address(obj, True)
    return addr, length, view, None


def _deadline_ms(deadline: Any) -> Optional[int]:
    if deadline is None:
        return None
    if isinstance(deadline, datetime.timedelta):
        deadline = deadline.total_seconds()
    return int(round(float(deadline) * 1000))


def _notify_args(notify: Any) -> tuple:
    if notify is None:
        return None, b""
    if isinstance(notify, str):
        return notify, b""
    if isinstance(notify, Notification):
        return notify.id, notify.payload
    nid, payload = notify
    return nid, payload


# --------------------------------------------------------------- asyncio

def _wake(fut: "asyncio.Future[None]") -> None:
    if not fut.done():
        fut.set_result(None)


async def _until_done(op: Operation) -> None:
    """Waits for `op` on the running loop, without blocking it: the
    operation's done-callback (on kvlink's callback thread) wakes the loop
    through call_soon_threadsafe."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def done() -> None:
        try:
            loop.call_soon_threadsafe(_wake, fut)
        except RuntimeError:  # the loop closed meanwhile: nobody waits any more
            pass

    op.add_done_callback(done)
    await fut


async def _await_op(op: Operation) -> Any:
    """The result of `op`. A cancelled task cancels the operation and still
    waits for it to finish, so the memory is free to reuse when the
    CancelledError arrives (the completion is the fence, as in C++)."""
    try:
        await _until_done(op)
    except asyncio.CancelledError:
        op.cancel()
        while not op.done():
            try:
                await _until_done(op)
            except asyncio.CancelledError:
                continue
        raise
    return op.result()


async def _in_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) on the loop's default executor (a blocking call
    that releases the GIL), awaited without blocking the loop. A call cannot
    be stopped midway: a cancelled task waits for it to finish before the
    CancelledError arrives, so the buffers are free to reuse then (the
    completion is the fence, as for the engine)."""
    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(None, functools.partial(fn, *args, **kwargs))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                continue
            except BaseException:
                break
        raise


# ---------------------------------------------------------------- engine

_live: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # Before the interpreter finalises, while threads can still take the GIL.
    for eng in list(_live):
        eng.close()


class Engine:
    """A kvlink engine with its own I/O thread. Thread-safe: every method may
    be called from any thread at once; blocking ones release the GIL."""

    def __init__(self, config: Optional[Dict[str, Any]] = None, *, use_env: bool = True,
                 **settings: Any) -> None:
        cfg = make_config(config, use_env=use_env, **settings)
        self._core = _kvlink.Engine(json.dumps(cfg))
        self._pins: Dict[int, Any] = {}
        self._lock = threading.Lock()
        _live.add(self)

    # -- life
    def close(self) -> None:
        """Closes the engine; transfers in flight fail with errc 'cancelled'.
        Registered memory may be freed once it returns. Idempotent."""
        self._core.close()
        with self._lock:
            self._pins.clear()

    def __del__(self) -> None:
        # Close before the attributes go: the pinned buffers must outlive
        # every access of a peer to them.
        core = getattr(self, "_core", None)
        if core is not None:
            try:
                core.close()
            except Exception:  # from a done-callback: the C++ side closes it on release
                pass

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- what it is
    @property
    def local_address(self) -> str:
        """host:port peers connect to (Engine.connect on their side)."""
        return self._core.local_address

    @property
    def listen_address(self) -> str:
        return self._core.listen_address

    @property
    def transports(self) -> str:
        """The transports offered, with the reason for those not usable here."""
        return self._core.transports

    @property
    def instance(self) -> str:
        return self._core.instance

    @property
    def config(self) -> Dict[str, Any]:
        return json.loads(self._core.config_json())

    @property
    def device_runtime(self) -> Optional[str]:
        """The device runtime device memory goes through ("cuda", "emulated"),
        None without one (setting `device`, KVLINK_DEVICE)."""
        return self._core.device_runtime

    # -- memory
    def register(self, memory: Any, length: Optional[int] = None, *,
                 access: str = "read_write", device: Optional[int] = None) -> int:
        """Registers memory for transfers and for peers to access ("none",
        "read", "write", "read_write"): an address with `length`, any
        writable contiguous buffer (numpy array, bytearray, mmap), a torch
        tensor (CPU, or CUDA: its storage from data_ptr() on), or device
        memory (__cuda_array_interface__, contiguous; a CUDA DLPack object),
        which stays referenced until unregistered. Device memory needs the
        engine's device runtime (setting `device`); an address is device
        memory where that runtime says so, or where `device` states it (the
        device's index; -1: any). Returns the segment id."""
        if isinstance(memory, int):
            if length is None:
                raise TypeError("register(address, length): the length is missing")
            addr, size, pin, dev = memory, int(length), None, device
        else:
            addr, size, pin, dev = _memory_of(memory)
            if device is not None:
                dev = device
            if length is not None:
                size = min(size, int(length))
        seg = self._core.register(addr, size, access, dev)
        if pin is not None:
            with self._lock:
                self._pins[seg] = pin
        return seg

    def unregister(self, segment: int, timeout: Optional[float] = None) -> None:
        """Unregisters and returns once no peer's access touches the segment."""
        self._core.unregister_async(segment).result(timeout)
        with self._lock:
            self._pins.pop(segment, None)

    def segments(self) -> List[SegmentInfo]:
        return self._core.segments()

    # -- peers
    def connect(self, name: str, timeout: Optional[float] = None) -> Peer:
        """Connects to a peer ("host:port", its local_address); connecting
        again to a live peer returns the same peer. `timeout`: seconds to wait
        (the engine's connect_timeout bounds the dial itself)."""
        op = self._core.connect_async(name)
        if not op.wait(timeout):
            raise _error("peer_unreachable", f"connect to {name}: no answer within {timeout} s")
        return op.result()

    async def aconnect(self, name: str) -> Peer:
        return await _await_op(self._core.connect_async(name))

    # -- transfers
    def submit(self, op: int, peer: Peer, local: Any, remote: Any, lengths: Any, *,
               segment: Any = None, notify: Any = None, deadline: Any = None,
               checksum: Optional[bool] = None) -> Operation:
        """Starts a batch and returns its Operation (wait(), result(), cancel(),
        add_done_callback()). `remote`: peer addresses, or offsets in
        `segment` (one id, or one per entry). `notify`: (id, payload) the
        peer receives after the data. `deadline`: seconds (None: the engine's
        transfer_deadline; 0: none)."""
        nid, payload = _notify_args(notify)
        return self._core.submit(op, peer, local, remote, lengths, segment, nid, payload,
                                 _deadline_ms(deadline), checksum)

    def write(self, peer: Peer, local: Any, remote: Any, lengths: Any, **kw: Any) -> TransferResult:
        """Local memory -> the peer's; returns once the peer has the bytes."""
        return self.submit(WRITE, peer, local, remote, lengths, **kw).result()

    def read(self, peer: Peer, local: Any, remote: Any, lengths: Any, **kw: Any) -> TransferResult:
        """The peer's memory -> local; returns once the bytes are here."""
        return self.submit(READ, peer, local, remote, lengths, **kw).result()

    async def awrite(self, peer: Peer, local: Any, remote: Any, lengths: Any,
                     **kw: Any) -> TransferResult:
        return await _await_op(self.submit(WRITE, peer, local, remote, lengths, **kw))

    async def aread(self, peer: Peer, local: Any, remote: Any, lengths: Any,
                    **kw: Any) -> TransferResult:
        return await _await_op(self.submit(READ, peer, local, remote, lengths, **kw))

    # -- notifications
    def send_notification(self, peer: Peer, id: str, payload: Union[bytes, str] = b"") -> None:
        """Sends a standalone notification; returns once it is handed to the kernel."""
        self._core.send_notification_async(peer, id, payload).result()

    async def asend_notification(self, peer: Peer, id: str,
                                 payload: Union[bytes, str] = b"") -> None:
        await _await_op(self._core.send_notification_async(peer, id, payload))

    def recv_notification(self, timeout: Optional[float] = None) -> Optional[Notification]:
        """The next notification from any peer, in arrival order; None after
        `timeout` seconds. Raises kvlink.Error (cancelled) once the engine closed."""
        return self._core.receive(timeout)

    def notifications(self) -> List[Notification]:
        """Every notification that has arrived, without waiting."""
        return self._core.drain()

    async def arecv_notification(self) -> Notification:
        """The next notification, awaited without blocking the event loop. A
        notification is never lost to a cancelled waiter: it goes back first
        in line."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        core = self._core

        def settle(n: Optional[Notification]) -> None:  # on the event loop
            if fut.cancelled():
                if n is not None:
                    core.put_back(n)
            elif n is None:
                fut.set_exception(_error("cancelled", "receive notification: the engine closed"))
            else:
                fut.set_result(n)

        def deliver(n: Optional[Notification]) -> None:  # on kvlink's callback thread
            try:
                loop.call_soon_threadsafe(settle, n)
            except RuntimeError:  # the loop is gone: keep the notification
                if n is not None:
                    core.put_back(n)

        ticket = core.receive_async(deliver)
        try:
            return await fut
        except asyncio.CancelledError:
            if not core.cancel_receive(ticket):
                # Handed over already: settle() puts it back, unless it ran
                # first and the cancellation came between it and this task.
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    core.put_back(fut.result())
            raise


# ----------------------------------------------------------------- store

_store_live: "weakref.WeakSet[StoreClient]" = weakref.WeakSet()


@atexit.register
def _close_stores() -> None:
    for st in list(_store_live):
        st.close()


class StoreClient:
    """A client of kvlink's KV-cache store: a `kvlink-master` holds the
    objects' metadata, clients hold their bytes in the memory they mount and
    move them between each other with an engine of their own (keywords:
    kvlink.config_table(); `listen` must be reachable by the other clients
    when this one mounts memory).

        store = kvlink.StoreClient("127.0.0.1:50051")   # or "etcd://h:2379": the elected master
        store.mount(1 << 30)                    # give 1 GiB to the pool (or a buffer)
        store.put("req-42/block-0", kv)         # any buffer: bytes, numpy array, memoryview
        data = store.get("req-42/block-0")      # bytes; get_into(key, buf) reads in place
        codes = store.put_batch(keys, values)   # one int per key: 0 or Mooncake's code

    Objects are immutable and the first writer wins. Single-key calls raise
    kvlink.Error (errc: "object_not_found", "object_already_exists",
    "no_space", ...; mooncake_code: Mooncake's integer); batches raise only
    for the batch as a whole (lists of different lengths, the master not
    reachable) and give one int per key, in input order: 0 (put, remove),
    the bytes read (get), 1/0 (exists), or Mooncake's negative code (-200
    no space, -704 not found, -705 exists already, -10 buffer too small).
    Every call blocks with the GIL released, bounded by request_timeout per
    master round trip and the engine's transfer_deadline for the bytes; the
    a-prefixed forms (aput, aget_batch, ...) await the same calls from
    asyncio without blocking the loop.
    Buffers inside memory given to register() are read and written in
    place; others go through staging memory (one copy). Thread-safe.

    disk_path / disk_capacity (bytes): the SSD tier, a directory on this
    host's disk where objects evicted from this client's memory are kept
    and read back from when they are read again (found again after a
    restart); raises kvlink.Error when the directory cannot be used."""

    def __init__(self, master: str = "127.0.0.1:50051", *, auth_secret: Optional[str] = None,
                 connect_timeout: float = 5.0, request_timeout: float = 10.0,
                 config: Optional[Dict[str, Any]] = None, use_env: bool = True,
                 disk_path: Optional[str] = None, disk_capacity: int = 0,
                 **settings: Any) -> None:
        cfg = make_config(config, use_env=use_env, **settings)
        self._core = _kvlink.StoreClient(json.dumps(cfg), master, auth_secret or "",
                                         float(connect_timeout), float(request_timeout),
                                         disk_path or "", int(disk_capacity))
        self._pins: Dict[int, Any] = {}   # engine segment -> what keeps its memory alive
        self._mounts: List[Any] = []      # mounted memory, kept until close
        self._pages: List[tuple] = []     # (address, length) mapped by mount(size)
        self._lock = threading.Lock()
        _store_live.add(self)

    # -- life
    def connect(self) -> None:
        """Connects to the master now (otherwise the first call does)."""
        self._core.connect()

    def close(self) -> None:
        """Unmounts this client's memory (its objects leave the pool) and
        closes the engine; calls in flight fail with errc 'cancelled'.
        Mounted and registered memory may be freed once it returns. Idempotent."""
        self._core.close()
        with self._lock:
            pages, self._pages = self._pages, []
            self._pins.clear()
            self._mounts.clear()
        for addr, length in pages:
            _kvlink.unmap_pages(addr, length)

    def __del__(self) -> None:
        if getattr(self, "_core", None) is not None:
            try:
                self.close()
            except Exception:
                pass

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def local_address(self) -> str:
        """host:port of this client's engine (where other clients reach its memory)."""
        return self._core.local_address

    @property
    def client_id(self) -> int:
        """This client's id at the master (0 before it connected)."""
        return self._core.client_id

    # -- memory
    def mount(self, memory: Any) -> int:
        """Gives memory to the pool: a size in bytes (page-aligned memory
        this client maps and unmaps at close) or a writable contiguous
        buffer, kept referenced until close(). Returns the store's segment id
        (for `preferred=`)."""
        if isinstance(memory, int):
            if memory <= 0:
                raise _error("invalid_argument", f"mount: {memory} bytes")
            addr = _kvlink.map_pages(memory)
            try:
                seg = self._core.mount(addr, memory)
            except BaseException:
                _kvlink.unmap_pages(addr, memory)
                raise
            with self._lock:
                self._pages.append((addr, memory))
            return seg
        view = memoryview(memory)
        addr, length = _kvlink.buffer_address(memory, True)
        seg = self._core.mount(addr, length)
        with self._lock:
            self._mounts.append(view)
        return seg

    def register(self, memory: Any, length: Optional[int] = None) -> int:
        """Registers memory with this client's engine, so that puts from and
        gets into it (or addresses inside it) need no staging copy: a
        writable contiguous buffer (numpy array, bytearray, mmap), a torch
        tensor (CPU, or CUDA with the engine's `device` runtime set), device
        memory (__cuda_array_interface__), or an address with `length`; kept
        referenced until unregistered. Returns its id."""
        if isinstance(memory, int):
            if length is None:
                raise TypeError("register(address, length): the length is missing")
            addr, size, pin = memory, int(length), None
        else:
            addr, size, pin, _ = _memory_of(memory)
            if length is not None:
                size = min(size, int(length))
        seg = self._core.register(addr, size)
        if pin is not None:
            with self._lock:
                self._pins[seg] = pin
        return seg

    def unregister(self, segment: int) -> None:
        self._core.unregister(segment)
        with self._lock:
            self._pins.pop(segment, None)

    # -- puts
    def put(self, key: str, value: Any = None, *, address: Optional[int] = None,
            size: Optional[int] = None, replicas: int = 1, preferred: Any = (),
            soft_pin: bool = False, hard_pin: bool = False) -> None:
        """Puts `value` (any buffer), or `size` bytes at `address` (inside
        registered memory), under `key`. Raises kvlink.Error
        (object_already_exists: the first writer won; no_space: back off)."""
        self._core.put(key, value, address, size,
                       _kvlink.PutConfig(replicas, list(preferred), soft_pin, hard_pin))

    def put_batch(self, keys: List[str], values: Any = None, *, addresses: Any = None,
                  sizes: Any = None, replicas: int = 1, preferred: Any = (),
                  soft_pin: bool = False, hard_pin: bool = False) -> List[int]:
        """Puts values[i] (buffers), or sizes[i] bytes at addresses[i]
        (ints, lists or int64 arrays; registered memory), under keys[i].
        One int per key: 0 or Mooncake's negative code."""
        return self._core.put_batch(keys, values, addresses, sizes,
                                    _kvlink.PutConfig(replicas, list(preferred), soft_pin,
                                                      hard_pin))

    def put_pieces(self, keys: List[str], addresses: Any, sizes: Any, counts: Any, *,
                   replicas: int = 1, preferred: Any = (), soft_pin: bool = False,
                   hard_pin: bool = False) -> List[int]:
        """Puts objects gathered from pieces: keys[i]'s object is the next
        counts[i] (address, size) pairs of the flat lists `addresses` and
        `sizes` (registered memory, host or device), in order: vLLM's K and
        V of every layer of one block as one object, with no gathering copy.
        One int per key: 0 or Mooncake's negative code (-600 for a key whose
        pieces hold no bytes)."""
        return self._core.put_pieces(keys, addresses, sizes, counts,
                                     _kvlink.PutConfig(replicas, list(preferred), soft_pin,
                                                       hard_pin))

    # -- gets
    def get(self, key: str) -> bytes:
        """The object's bytes. Raises kvlink.Error (object_not_found, ...)."""
        return self._core.get_bytes(key, 1 << 20)

    def get_into(self, key: str, buffer: Any = None, *, address: Optional[int] = None,
                 capacity: Optional[int] = None) -> int:
        """Reads the object into a writable buffer (or `capacity` bytes at
        `address`, inside registered memory); returns its size. Raises
        kvlink.Error (buffer_overflow: the buffer is smaller than the object)."""
        return self._core.get_into(key, buffer, address, capacity)

    def get_batch(self, keys: List[str], buffers: Any = None, *, addresses: Any = None,
                  capacities: Any = None) -> List[int]:
        """Reads keys[i] into buffers[i] (or capacities[i] bytes at
        addresses[i]). One int per key: the bytes read, or Mooncake's
        negative code."""
        return self._core.get_batch(keys, buffers, addresses, capacities)

    def get_pieces(self, keys: List[str], addresses: Any, sizes: Any, counts: Any) -> List[int]:
        """Reads objects scattered over pieces (see put_pieces): keys[i]'s
        bytes fill its counts[i] pieces in order, the last one as far as the
        object goes. One int per key: the bytes read, or Mooncake's negative
        code (-10 when the pieces hold fewer bytes than the object: nothing
        is written)."""
        return self._core.get_pieces(keys, addresses, sizes, counts)

    # -- exists and remove
    def exists(self, key: str) -> bool:
        return self._core.exists(key)

    def exists_batch(self, keys: List[str]) -> List[int]:
        """One int per key: 1 there, 0 not (or its put not ended), < 0 an error."""
        return self._core.exists_batch(keys)

    def remove(self, key: str, *, force: bool = False) -> None:
        """Removes the object (force: even while read or hard-pinned)."""
        self._core.remove(key, force)

    def remove_batch(self, keys: List[str], *, force: bool = False) -> List[int]:
        return self._core.remove_batch(keys, force)

    def remove_all(self, *, force: bool = False) -> int:
        """Removes every object (force: leased and hard-pinned ones too);
        returns how many went."""
        return self._core.remove_all(force)

    def describe_batch(self, keys: List[str]) -> List[Dict[str, Any]]:
        """Where each key's object is, in input order, without reading it and
        without a read lease (a replica may be gone by the time it is used):
        {"code": 0, "size": n, "replicas": [{"segment", "offset", "address"
        (its owner's engine), "host", "local" (a segment of this client)}]},
        or {"code": Mooncake's negative code, "error": the error's name}."""
        return self._core.describe_batch(keys)

    def stats(self) -> Dict[str, int]:
        """The pool's totals: capacity, used, objects, in_progress, reserved, segments."""
        return self._core.stats()

    # -- asyncio: the calls above, awaited on the running loop (each runs on
    # the loop's default executor with the GIL released; a cancelled task
    # still waits for its call to finish, so its buffers are free when the
    # CancelledError arrives)
    async def aput(self, key: str, value: Any = None, **kwargs: Any) -> None:
        return await _in_thread(self.put, key, value, **kwargs)

    async def aput_batch(self, keys: List[str], values: Any = None, **kwargs: Any) -> List[int]:
        return await _in_thread(self.put_batch, keys, values, **kwargs)

    async def aget(self, key: str) -> bytes:
        return await _in_thread(self.get, key)

    async def aget_into(self, key: str, buffer: Any = None, **kwargs: Any) -> int:
        return await _in_thread(self.get_into, key, buffer, **kwargs)

    async def aget_batch(self, keys: List[str], buffers: Any = None, **kwargs: Any) -> List[int]:
        return await _in_thread(self.get_batch, keys, buffers, **kwargs)

    async def aexists(self, key: str) -> bool:
        return await _in_thread(self.exists, key)

    async def aexists_batch(self, keys: List[str]) -> List[int]:
        return await _in_thread(self.exists_batch, keys)

    async def aremove(self, key: str, *, force: bool = False) -> None:
        return await _in_thread(self.remove, key, force=force)

    async def aremove_batch(self, keys: List[str], *, force: bool = False) -> List[int]:
        return await _in_thread(self.remove_batch, keys, force=force)
