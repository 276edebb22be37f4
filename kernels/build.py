"""The sm_90a build report shared by both DSLs: registers, spills, shared memory and an instruction census per
kernel, and the traffic record the performance model (flashkern.model) reads.

Both paths go through PTX and end in ptxas, assembled as each DSL's own JIT assembles it (an `Assembler`: Triton's
backend.make_cubin with its flags, which differ by version; TileLang's nvcc with its flags), so the registers, spills
and stack are the ones the JIT's binary has. One parser reads both `-v` logs, one census reads both PTX texts, and
each report carries the GPU lint's findings (kernels.gpu_lint). Reports of slow builds (TileLang's: lowering and
nvcc take 2-25 s) are kept on disk by `cached_report`; Triton keeps its own cache of compiled kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from flashkern.kernels import gpu_lint, sass, ttgir


_MMA_TYPES = (("e4m3", "fp8"), ("e5m2", "fp8"), ("bf16", "bf16"), ("f16", "fp16"), ("tf32", "tf32"), ("s8", "int8"))
_TENSOR_CORE = re.compile(r"^\s*(?:@\S+\s+)?(wgmma\.mma_async|mma\.sync)\S*", re.M)
_GLOBAL = re.compile(r"^\s*(?:@\S+\s+)?(ld|st)\.global\S*", re.M)
# an atomic's state space: "shared" (.shared, .shared::cta, .shared::cluster), "global", or "" (generic: no space,
# as `atom.acq_rel.gpu.add.s32`, which our kernels only aim at global memory)
_ATOMIC_SPACE = re.compile(r"(?<![\w.%$])(?:atom|red)(?=\.)(?:\.(?!global|shared)[\w:]+)*(?:\.(global|shared))?")
_WIDTH = re.compile(r"\.v(\d)|\.[busf](\d+)\b")


def _access_bytes(instruction: str) -> int:
    """Bytes one thread moves with a ld/st instruction such as ld.global.nc.v4.b32 (16)."""
    lanes, bits = 1, 0
    for vector, width in _WIDTH.findall(instruction):
        lanes = int(vector) if vector else lanes
        bits = int(width) if width else bits
    return lanes * bits // 8


@dataclass(frozen=True)
class Census:
    """Static instruction counts in a kernel's PTX: each instruction once where it is written (a loop body counts
    once, an unrolled loop once per copy). Which tensor-core paths, copy engines and vector widths a build uses;
    not how often they run."""

    wgmma: int = 0  # Hopper warpgroup MMA (wgmma.mma_async)
    mma_sync: int = 0  # warp-level MMA (mma.sync)
    mma_input: str = ""  # tensor-core input type: fp8, bf16, fp16, tf32, int8; "" without MMA
    cp_async: int = 0  # Ampere asynchronous global -> shared copies
    tma: int = 0  # Hopper tensor-memory-accelerator copies (cp.async.bulk.tensor)
    global_loads: int = 0
    widest_load: int = 0  # bytes per thread of the widest global load (16: 128-bit vectors)
    global_stores: int = 0
    global_atomics: int = 0  # atom / red on global or generic addresses (atom.global.add, atom.acq_rel.gpu.add)
    shared_atomics: int = 0
    barriers: int = 0  # bar.sync / barrier.sync and mbarrier operations

    @staticmethod
    def of(ptx: str) -> Census:
        mma = _TENSOR_CORE.findall(ptx)
        first = _TENSOR_CORE.search(ptx)
        mma_input = ""
        if first:
            line = ptx[first.start(): ptx.find("\n", first.start())]
            mma_input = next((kind for suffix, kind in _MMA_TYPES if f".{suffix}" in line), "other")
        loads = [m.group(0) for m in _GLOBAL.finditer(ptx) if m.group(1) == "ld"]
        return Census(
            wgmma=mma.count("wgmma.mma_async"), mma_sync=mma.count("mma.sync"), mma_input=mma_input,
            cp_async=len(re.findall(r"\bcp\.async\.c[ag]\b", ptx)), tma=len(re.findall(r"\bcp\.async\.bulk\.tensor", ptx)),
            global_loads=len(loads), widest_load=max(map(_access_bytes, loads), default=0),
            global_stores=sum(1 for m in _GLOBAL.finditer(ptx) if m.group(1) == "st"),
            global_atomics=sum(1 for space in _ATOMIC_SPACE.findall(ptx) if space != "shared"),
            shared_atomics=sum(1 for space in _ATOMIC_SPACE.findall(ptx) if space == "shared"),
            barriers=len(re.findall(r"\b(?:bar\.sync|barrier\.sync|bar\.arrive|mbarrier\.)", ptx)),
        )

    @staticmethod
    def total(censuses) -> Census:
        """Counts summed over kernels; the widest load and the first tensor-core type found."""
        censuses = list(censuses)
        counts = {f.name: sum(getattr(c, f.name) for c in censuses) for f in dataclasses.fields(Census)
                  if f.name not in ("mma_input", "widest_load")}
        return Census(**counts, widest_load=max((c.widest_load for c in censuses), default=0),
                      mma_input=next((c.mma_input for c in censuses if c.mma_input), ""))


@dataclass(frozen=True)
class BuildReport:
    registers: int = 0  # per thread
    spill_stores: int = 0  # bytes
    spill_loads: int = 0  # bytes
    stack: int = 0  # bytes of stack frame per thread
    smem: int = 0  # bytes of shared memory per block (static + dynamic)
    threads: int = 0  # per block
    census: Census = Census()  # instructions in the PTX
    issue: sass.Profile | None = None  # the SASS per pipe, outside loops and per loop trip (kernels.sass)
    hazards: tuple[str, ...] = ()  # the GPU lint's findings in the built code (kernels.gpu_lint)

    def with_(self, **changes) -> BuildReport:
        return dataclasses.replace(self, **changes)

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    @staticmethod
    def merge(reports) -> BuildReport:
        """One report for the kernels of a multi-stage implementation: the largest figure of each kind."""
        reports = list(reports)
        fields = ("registers", "spill_stores", "spill_loads", "stack", "smem", "threads")
        merged = {name: max(getattr(r, name) for r in reports) for name in fields}
        hazards = tuple(dict.fromkeys(h for r in reports for h in r.hazards))
        return BuildReport(**merged, census=Census.total(r.census for r in reports), hazards=hazards)  # no issue

    @property
    def wgmma(self) -> bool:
        """Hopper warpgroup MMA present in the generated code."""
        return self.census.wgmma > 0

    @staticmethod
    def from_dict(values: dict) -> BuildReport:
        """The inverse of dataclasses.asdict."""
        issue = values.get("issue")
        return BuildReport(**{**values, "census": Census(**values["census"]), "hazards": tuple(values["hazards"]),
                              "issue": None if issue is None else sass.Profile.from_dict(issue)})


CACHE_ENV = "FLASHKERN_BUILD_CACHE"  # a folder for build reports, or "off"


def source_digest(module_file: str) -> str:
    """sha256 of a module's source: a cache key part that changes whenever the module does."""
    return hashlib.sha256(Path(module_file).read_bytes()).hexdigest()


# how reports are made, read, linted and stored
_THIS_SOURCE = "".join(source_digest(path) for path in (__file__, sass.__file__, gpu_lint.__file__, ttgir.__file__))


def cache_dir() -> Path | None:
    """Where build reports are kept: $FLASHKERN_BUILD_CACHE, else <user cache dir>/flashkern/sm90-builds; None
    when the variable is "off"."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen == "off":
        return None
    if chosen:
        return Path(chosen)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("flashkern")) / "sm90-builds"


def cached_report(depends_on: tuple, build: Callable[[], BuildReport]) -> BuildReport:
    """build()'s report, or the stored report of an earlier build with the same `depends_on` (everything the build
    reads: the kernel's IR text, the options, the compiler versions and the building code's source). A failed build
    stores nothing; a stored file that cannot be read is built again and replaced."""
    folder = cache_dir()
    if folder is None:
        return build()
    key = (_THIS_SOURCE, depends_on, _PROFILING_ISSUE.get())
    path = folder / (hashlib.sha256(repr(key).encode()).hexdigest() + ".json")
    try:
        return BuildReport.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        pass
    report = build()
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as f:
        json.dump(dataclasses.asdict(report), f)
    os.replace(f.name, path)  # whole or absent, with concurrent builders of the same kernel
    return report


_PROFILING_ISSUE = contextvars.ContextVar("flashkern_profiling_issue", default=False)


@contextlib.contextmanager
def profiling_issue(on: bool = True):
    """Builds inside also make the SASS issue profile (a second, counting build: kernels.sass), which the
    performance model reads; the build check does without it."""
    token = _PROFILING_ISSUE.set(on)
    try:
        yield
    finally:
        _PROFILING_ISSUE.reset(token)


_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(text: str) -> BuildReport:
    """Read `ptxas -v` output; with several kernels, the largest figure of each kind."""
    regs = smem = stack = stores = loads = 0
    found = False
    for m in _USED.finditer(text):
        found = True
        regs = max(regs, int(m.group(1)))
        smem = max(smem, int(m.group(2) or 0))
    for m in _FRAME.finditer(text):
        stack = max(stack, int(m.group(1)))
        stores = max(stores, int(m.group(2)))
        loads = max(loads, int(m.group(3)))
    if not found:
        raise RuntimeError("no register usage in the ptxas output:\n" + text[-2000:])
    return BuildReport(registers=regs, spill_stores=stores, spill_loads=loads, stack=stack, smem=smem)


Assembler = Callable[[str], tuple[bytes, str]]  # PTX -> (the cubin, the assembler's verbose log)


def command_assembler(command: list[str]) -> Assembler:
    """An Assembler running `command` (a ptxas, or nvcc -cubin, with its verbose resource flag and line info; the
    PTX path and `-o cubin` are appended)."""

    def run(ptx: str) -> tuple[bytes, str]:
        with tempfile.TemporaryDirectory(prefix="flashkern-sm90-") as tmp:
            path, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
            with open(path, "w") as f:
                f.write(ptx)
            proc = subprocess.run([*command, path, "-o", cubin], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{os.path.basename(command[0])} failed:\n" + (proc.stderr or proc.stdout)[-4000:])
            return Path(cubin).read_bytes(), proc.stdout + proc.stderr

    return run


def assemble(ptx: str, assembler: Assembler, sources: dict | None = None, hazards: tuple[str, ...] = ()) -> BuildReport:
    """Assemble `ptx` for sm_90a: resources from the assembler's log, the census from the PTX, the issue profile
    from a second, counting build by the same assembler (kernels.sass) inside `profiling_issue` (`sources`: path ->
    text of the sources the PTX's line info names, for loop headers); `hazards`: the GPU lint's findings."""
    _, log = assembler(ptx)
    issue = sass.profile(ptx, assembler, sources) if _PROFILING_ISSUE.get() else None
    return parse_ptxas(log).with_(census=Census.of(ptx), issue=issue, hazards=hazards)


class TensorTraffic(NamedTuple):
    """One tensor's share of a launch's traffic (one distinct storage)."""

    requested: float  # bytes the launch's CTAs request of it, loads and stores, every re-read counted
    stored: float  # bytes of its storage
    # (gap, bytes): bytes a CTA reads that the CTA launched `gap` places before it read too, in launch order
    # (blockIdx.x fastest): what a grid streaming shared data in lockstep can find in L2 (flashkern.model)
    shared: tuple = ()


@dataclass(frozen=True)
class LaunchTraffic:
    """Global-memory traffic of one kernel launch as its design requests it (a model input, not a measurement).

    Every byte a load or store asks of global memory counts, each time it is asked: data re-read by a CTA or by
    many CTAs, partials written and read back. Masked-off lanes move nothing. Whether L2 would serve a re-read is
    the model's business, not this count's.
    """

    ctas: int  # CTAs in the grid
    bytes_read: float  # loads (and the read half of atomics), all CTAs
    bytes_written: float  # stores (and the write half of atomics), all CTAs
    sampled: int  # CTAs actually counted; the totals are scaled from them when fewer than ctas
    exact: bool = True  # False: an upper bound (conditions the count could not evaluate were taken as true)
    # What the model reads beside the counts (not part of a count's equality):
    lines: tuple = dataclasses.field(default=(), compare=False)  # ((file, line), runs per CTA) where the count ran
    cta_lines: tuple = dataclasses.field(default=(), compare=False)  # per traced CTA: its ((file, line), runs)
    sizes: tuple = dataclasses.field(default=(), compare=False)  # (name, value): scalar parameters and sizes
    tensors: tuple[TensorTraffic, ...] = dataclasses.field(default=(), compare=False)  # per distinct storage

    @property
    def bytes(self) -> float:
        return self.bytes_read + self.bytes_written

    @property
    def footprint(self) -> float:
        """Bytes of every tensor the launch can touch."""
        return sum(tensor.stored for tensor in self.tensors)


NO_TRAFFIC = LaunchTraffic(ctas=0, bytes_read=0, bytes_written=0, sampled=0)  # a stage with nothing to launch
