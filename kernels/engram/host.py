"""Engram's host side: a table in host memory backed by transparent huge pages, a multi-threaded CPU gather, and
prefetch (start the hash and lookup as soon as a batch's token ids are known; wait where the layer needs them).

A V4.1-Flash Engram table is about 384M rows of 264 bytes (94 GiB a layer): host memory, read at random. With
4 KiB pages every row read is a TLB miss walking a page table far beyond the caches; 2 MiB pages cut the walks
512-fold (docs/operators.md section 9.3 has the measurements). On a GPU the kernels read the table through UVA
when it is pinned (registered with CUDA): `HostTable(rows, pin=True)`.
"""

from __future__ import annotations

import contextvars
import ctypes
import mmap
import re
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.utils.dlpack

from flashkern.reference.engram import ROW_BYTES, ROW_VALUES

THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
HUGE_PAGE = 2 << 20
CUDA_HOST_REGISTER_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


def transparent_huge_pages() -> str:
    """The kernel's transparent huge page mode: "always", "madvise", "never", or "unavailable" (no such setting)."""
    try:
        with open(THP_SETTING) as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)
    except (OSError, AttributeError):
        return "unavailable"


class HostTable:
    """An Engram table [rows, 264] uint8 in anonymous host memory (`tensor`), 2 MiB-aligned.

    huge_pages=True asks the kernel for transparent huge pages (madvise(MADV_HUGEPAGE)); False forbids them
    (MADV_NOHUGEPAGE, the baseline). `huge_pages_state` says what was granted as far as the process can tell, and a
    warning says when huge pages were asked for and cannot be had. pin=True registers the memory with CUDA
    (cudaHostRegister, portable and mapped) so that GPU kernels read it through UVA.
    """

    def __init__(self, rows: int, *, huge_pages: bool = True, pin: bool = False):
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.nbytes = rows * ROW_BYTES
        size = -(-self.nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to start on a 2 MiB boundary
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        skip = -whole.data_ptr() % HUGE_PAGE
        self.huge_pages_state = self._advise(huge_pages)
        self.tensor = whole[skip: skip + self.nbytes].view(rows, ROW_BYTES)
        self.pinned = False
        if pin:
            self._register()

    def _advise(self, huge_pages: bool) -> str:
        mode = transparent_huge_pages()
        advice = getattr(mmap, "MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE", None)
        if advice is None or mode == "unavailable":
            state = "unavailable: this system has no transparent huge pages"
        else:
            try:
                self._map.madvise(advice)
                state = ("asked (madvise)" if mode != "never" else "refused: transparent huge pages are 'never'") \
                    if huge_pages else "off (MADV_NOHUGEPAGE)"
            except OSError as error:
                state = f"refused: madvise failed ({error})"
        if huge_pages and not state.startswith("asked"):
            warnings.warn(f"HostTable: no transparent huge pages ({state}); random row reads will miss the TLB",
                          RuntimeWarning, stacklevel=3)
        return state

    def _register(self) -> None:
        cudart = torch.cuda.cudart()
        code = cudart.cudaHostRegister(self.tensor.data_ptr(), self.nbytes, CUDA_HOST_REGISTER_PORTABLE_MAPPED)
        if int(code) != 0:
            raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed with CUDA error {int(code)}")
        self.pinned = True

    def huge_page_bytes(self) -> int:
        """Bytes of the table the kernel backs with huge pages now (AnonHugePages of its mapping, /proc/self/smaps;
        0 where that file is absent). Pages are granted as memory is first touched."""
        start, end = self.tensor.data_ptr(), self.tensor.data_ptr() + self.nbytes
        total, inside = 0, False
        try:
            with open("/proc/self/smaps") as f:
                for line in f:
                    head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
                    if head:
                        low, high = int(head.group(1), 16), int(head.group(2), 16)
                        inside = low < end and high > start
                    elif inside and line.startswith("AnonHugePages:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            return 0
        return total

    def close(self) -> None:
        """Unregister (when pinned) and release the memory; the tensor must not be used afterwards."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        del self.tensor
        self._map.close()


_DL_CUDA = 2  # DLPack's kDLCUDA
_DEVICE_FIELD = 8  # byte offset of DLTensor.device (after the data pointer) in a DLManagedTensor


def cuda_view(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor on `device` over a pinned host tensor's memory (no copy; it keeps the table alive), for
    launchers that refuse a CPU tensor for a CUDA kernel (TileLang's) while the kernel reads it through UVA: the
    tensor's DLPack record with its device rewritten, as vLLM's get_cuda_view_from_cpu_tensor does in C++."""
    capsule = torch.utils.dlpack.to_dlpack(table)
    kind, index = dlpack_device(capsule)
    kind.value, index.value = _DL_CUDA, torch.device(device).index or 0
    return torch.utils.dlpack.from_dlpack(capsule)


def dlpack_device(capsule) -> tuple[ctypes.c_int32, ctypes.c_int32]:
    """The device type and index fields of a DLPack capsule's tensor record, in place."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    record = get(capsule, b"dltensor")
    return ctypes.c_int32.from_address(record + _DEVICE_FIELD), ctypes.c_int32.from_address(record + _DEVICE_FIELD + 4)


def gather(table: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None, *, workers: int | None = None,
           backend: str = "tilelang", config: dict | None = None) -> torch.Tensor:
    """engram_lookup of CPU tensors on `workers` threads (default: torch's intra-op threads), each a slice of the
    tokens; the TileLang C kernel runs without the GIL, so the slices run in parallel. Returns out [T, L, 256]."""
    from flashkern.kernels.engram import engram_lookup

    out = torch.empty(*rows.shape, ROW_VALUES, dtype=torch.bfloat16) if out is None else out
    workers = max(1, min(workers or torch.get_num_threads(), rows.shape[0]))
    bounds = [rows.shape[0] * i // workers for i in range(workers + 1)]
    call = lambda a, b: engram_lookup(table, rows[a:b], out=out[a:b], backend=backend, config=config)  # noqa: E731
    if workers == 1:
        return call(0, rows.shape[0])
    call(bounds[0], bounds[1])  # the first slice on this thread: a compile (once per process) is never concurrent
    with ThreadPoolExecutor(workers - 1) as pool:  # each slice in the caller's context (checked mode and the like)
        for done in [pool.submit(contextvars.copy_context().run, call, a, b)
                     for a, b in zip(bounds[1:-1], bounds[2:])]:
            done.result()
    return out


class Prefetch:
    """A started Engram lookup: wait() returns its output once written (on a GPU: the current stream waits for the
    side stream's work; on the CPU: the worker thread's)."""

    def __init__(self, out: torch.Tensor, future: Future | None = None, event=None):
        self.out, self._future, self._event = out, future, event

    def wait(self) -> torch.Tensor:
        if self._future is not None:
            self._future.result()
        if self._event is not None:
            torch.cuda.current_stream(self.out.device).wait_event(self._event)
        return self.out


_CPU_WORKER = ThreadPoolExecutor(1, thread_name_prefix="flashkern-engram-prefetch")
_IN_FLIGHT: dict[int, Future] = {}  # out.data_ptr() -> the CPU prefetch writing it, until it is done
_IN_FLIGHT_LOCK = threading.Lock()


def engram_prefetch(table: torch.Tensor, token_ids: torch.Tensor, seq_ids: torch.Tensor, hash_inputs: dict,
                    out: torch.Tensor, *, history: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                    stream=None, backend: str = "auto", config: dict | None = None) -> Prefetch:
    """Start engram_hash and engram_lookup (backend; config: the lookup's) for a batch as soon as its token ids are
    known; returns a Prefetch whose wait() gives `out` [T, L, 256] bf16.

    GPU (token ids on CUDA): the work goes on `stream` (default: a side stream of the device) after everything
    already queued on the current stream (so a buffer the previous step still reads is not overwritten), and
    wait() makes the current stream wait for it. CPU: a worker thread (the lookup on `gather`'s threads); a
    prefetch into an `out` that an earlier prefetch is still writing first waits for that one. hash_inputs:
    EngramParams.hash_inputs() on the ids' device; rows: an optional int64 [T, L] buffer for the row ids, reused
    across steps like out. Kernels compile on first use: on the CPU, call the operators once before overlapping
    them with other TileLang work (TileLang's C compiles are not thread-safe).
    """
    from flashkern.kernels.engram import engram_hash, engram_lookup

    def run() -> torch.Tensor:
        ids = engram_hash(token_ids, seq_ids, **hash_inputs, history=history, backend=backend, out=rows)
        if token_ids.is_cuda:
            return engram_lookup(table, ids, backend=backend, config=config, out=out)
        return gather(table, ids, out, backend=backend, config=config)

    if token_ids.is_cuda:
        side = stream if stream is not None else _side_stream(token_ids.device)
        side.wait_stream(torch.cuda.current_stream(token_ids.device))
        with torch.cuda.stream(side):
            run()
            event = torch.cuda.Event()
            event.record(side)
        for tensor in (token_ids, seq_ids, out, rows, history):
            if tensor is not None:
                tensor.record_stream(side)  # the caching allocator keeps them until the side stream is done
        return Prefetch(out, event=event)
    key = out.data_ptr()
    with _IN_FLIGHT_LOCK:
        earlier = _IN_FLIGHT.get(key)
    if earlier is not None:
        earlier.result()
    future = _CPU_WORKER.submit(contextvars.copy_context().run, run)  # in the caller's context (checked mode)
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT[key] = future
    future.add_done_callback(lambda done: _forget(key, done))
    return Prefetch(out, future=future)


def _forget(key: int, done: Future) -> None:
    with _IN_FLIGHT_LOCK:
        if _IN_FLIGHT.get(key) is done:
            del _IN_FLIGHT[key]


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]
