"""What an sm_90a kernel issues: its SASS, read from a cubin, as instructions per pipe, per loop.

`profile(ptx, assemble)` assembles the PTX a second time with loop unrolling off (module-scope
`.pragma "nounroll"`) and line info on, disassembles that cubin with the `nvdisasm` Triton's wheel ships, and
counts, for the code outside loops and for each loop body (nested loops excluded), the warp instructions of each
pipe. Unrolling off makes one trip of a SASS loop one trip of the source loop, so the source's trip counts apply
as they are (ptxas otherwise unrolls dynamic loops by 4 with remainder loops); the counts are the unrolled
build's up to loop overhead. The resources the model reports come from the real build (kernels.build.assemble).

Loops are natural loops of the control-flow graph (a branch to a block that dominates it closes one);
branches to one header make one loop. Each loop records the source line of its back edge (the source
loop's header: `for ...` in Python or CUDA C), which is how a trip count is looked up (`Trips`).

Pipes and their issue rates (warp instructions per cycle per SM sub-partition; an SM has 4, each issuing at
most one warp instruction a cycle) follow Nsight Compute's pipe names (Kernel Profiling Guide, "Pipelines")
and the CUDA C++ Programming Guide's throughput table for compute capability 9.0 (operations per clock per SM,
divided by 4 sub-partitions x 32 lanes):
  fma     FP32 FFMA/FADD/FMUL, HFMA2 and friends: 128 results/clk/SM -> 1
  fmaheavy IMAD/IMUL and integer dot products (the heavy half of the FMA pipe): 64/clk/SM -> 0.5
  alu     integer add/compare/min/max, shifts, LOP3, PRMT, SEL, FP32 compare (FSETP/FMNMX): 64/clk/SM -> 0.5
  xu      MUFU (exp2, rcp, rsqrt, ...), conversions (F2F, F2I, I2F, FRND), POPC/FLO/BREV: 16/clk/SM -> 0.125
  lsu     global/local/shared loads and stores, atomics, shuffles, S2R: 32 threads/clk/SM (shuffle) -> 0.25
  tensor  HMMA/HGMMA/IMMA: issue slots only (their math is the model's tensor-core term)
  other   branches, barriers, uniform datapath, moves the scheduler issues (MOV, NOP, ...) -> 1
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ISSUE_RATE = {"fma": 1.0, "fmaheavy": 0.5, "alu": 0.5, "xu": 0.125, "lsu": 0.25, "tensor": 1.0, "other": 1.0}
PIPES = tuple(ISSUE_RATE)

_PIPE_BY_OPCODE = {
    "fma": ("FFMA", "FADD", "FMUL", "FMUL32I", "FFMA32I", "FADD32I", "HFMA2", "HADD2", "HMUL2", "HMNMX2", "FSWZADD",
            "FCHK"),
    "fmaheavy": ("IMAD", "IMUL", "IDP", "IMAD32I", "IMUL32I"),
    "alu": ("IADD3", "IADD", "IADD32I", "VIADD", "VIADDMNMX", "IABS", "IMNMX", "ISETP", "ICMP", "LOP3", "LOP", "LOP32I",
            "SHF", "SHL", "SHR", "LEA", "PRMT", "SEL", "FSEL", "FSETP", "FMNMX", "FSET", "HSETP2", "HSET2", "SGXT",
            "BMSK", "PLOP3", "P2R", "R2P", "CSET", "CSETP", "ISCADD", "VABSDIFF", "VABSDIFF4", "VIMNMX", "VIMNMX3",
            "IMNMX3", "F2FP", "BFE", "BFI"),
    "xu": ("MUFU", "F2F", "F2I", "I2F", "I2FP", "F2IP", "FRND", "POPC", "FLO", "BREV"),
    "lsu": ("LDG", "STG", "LDS", "STS", "LDL", "STL", "LD", "ST", "ATOM", "ATOMS", "ATOMG", "RED", "REDG", "LDSM",
            "STSM", "LDGSTS", "SHFL", "S2R", "CS2R", "MATCH", "VOTE", "LDGDEPBAR", "MEMBAR", "CCTL", "LDC", "REDUX",
            "SYNCS", "UBLKCP", "UTMALDG", "UTMASTG", "UTMAPF", "UTMACCTL"),
    "tensor": ("HMMA", "HGMMA", "IMMA", "IGMMA", "QGMMA", "DMMA", "WARPGROUP", "BMMA"),
}
_PIPE = {opcode: pipe for pipe, opcodes in _PIPE_BY_OPCODE.items() for opcode in opcodes}
# What the latency floor reads (flashkern.model): CTA barriers, loads that block on global memory, asynchronous
# copies (cp.async, TMA), which a pipelined loop waits on stages later, and global phases: barriers reached with
# a blocking global load issued since the last barrier (in the same loop body or a loop inside it).
# local_bytes: bytes a warp moves to and from local memory (register spills: LDL / STL, 32 lanes x the access
# width), which flashkern.model charges to L1 (and to L2 where the CTAs' stack frames outgrow it).
EVENTS = {"barrier": ("BAR",), "global_load": ("LDG", "LD", "ATOMG", "ATOM"), "async_copy": ("LDGSTS", "UTMALDG",
                                                                                             "UBLKCP"),
          "global_phase": (), "local_bytes": ()}
_LOCAL_ACCESS = ("LDL", "STL")
_LOCAL_WIDTH = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}  # bytes a lane; 4 unless modified


def local_bytes(opcode: str) -> int:
    """Bytes a warp moves with a local load or store (LDL.64: 32 x 8), 0 for any other opcode."""
    base, *modifiers = opcode.split(".")
    if base not in _LOCAL_ACCESS:
        return 0
    return 32 * next((_LOCAL_WIDTH[m] for m in modifiers if m in _LOCAL_WIDTH), 4)
_EVENT = {opcode: event for event, opcodes in EVENTS.items() for opcode in opcodes}

_CONTROL = ("BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "CALL")  # instructions that end a basic block
_LINE = re.compile(r'^\s*//## File "(?P<file>[^"]+)", line (?P<line>\d+)(?P<inlined> inlined at)?')
_INSTRUCTION = re.compile(r"^\s*/\*(?P<address>[0-9a-f]{4,})\*/\s+(?P<predicate>@!?U?P\w+\s+)?(?P<opcode>[A-Z][\w.]*)"
                          r"\s*(?P<operands>[^;]*);")
_FUNCTION = re.compile(r"^//-+ \.text\.(?P<name>\S+)")
_TARGET = re.compile(r"`\(\.L_x_(\d+)\)")
_LABEL = re.compile(r"^\.L_x_(\d+):")


def pipe(opcode: str) -> str:
    """The pipe a SASS opcode (with or without modifiers: "IMAD.WIDE.U32") issues to."""
    return _PIPE.get(opcode.split(".")[0], "other")  # "other": uniform datapath (UIADD3, ULDC...), moves, control


@dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str
    operands: str
    line: tuple[str, int] | None  # (file, line) from the line info, the innermost of an inlining; None without it
    target: int | None = None  # a branch's target address
    predicated: bool = False  # runs under a predicate (@P0): a predicated branch may fall through
    site: tuple[str, int] | None = None  # the outermost line of the inlining: the kernel body's own line


@dataclass(frozen=True)
class Loop:
    """One SASS loop: its own instructions per pipe (nested loops excluded) and where its back edge comes from."""

    start: int
    end: int  # address of the (last) back-edge branch
    parent: int  # index of the enclosing loop in Profile.loops, -1 at the top level
    counts: dict  # pipe (and EVENTS) -> warp instructions per trip
    header: tuple[str, int] | None  # source (file, line) of the back-edge branch: the source loop's header
    header_text: str = ""  # that source line, where the build kept its source (TileLang's CUDA C)
    share: float = 1.0  # of the warps that reach its parent, the share that runs it (see `count`)


@dataclass(frozen=True)
class Profile:
    """A kernel's SASS: instructions outside loops and per loop trip, per pipe."""

    straight: dict  # pipe (and EVENTS) -> warp instructions executed once per CTA
    loops: tuple[Loop, ...] = ()
    # the straight-line instructions with line info, by their outermost source line (Instruction.site):
    # ((file, line), pipe (and EVENTS) -> count)
    straight_lines: tuple = ()

    def weights(self, trips) -> list[float]:
        """Trips of each loop per CTA, times the share of a CTA's warps that run it (its and its parents')."""
        weights: list[float] = []
        shares: list[float] = []
        for i, loop in enumerate(self.loops):
            shares.append(loop.share * (shares[loop.parent] if loop.parent >= 0 else 1.0))
            weights.append(trips[i] * shares[i])
        return weights

    def executed(self, trips, line_runs: dict | None = None, traced: dict | None = None) -> dict:
        """pipe (and event) -> warp instructions a warp issues on average, `trips[i]` being the trips of loop i
        per CTA. With line_runs ((file, line) -> executions per CTA, as the traffic count traced them), straight-line
        code whose source line ran less than once per CTA counts that often (a branch most CTAs skip: a last
        arrival's epilogue); a line `traced` saw run but line_runs did not ran 0 times; lines neither saw count
        once."""
        total = dict.fromkeys((*PIPES, *EVENTS), 0.0)
        for pipe_name, count in self.straight.items():
            total[pipe_name] += count
        for line, counts in self.straight_lines if line_runs is not None else ():
            runs = header_executions(line, line_runs)
            if runs is None and traced is not None and header_executions(line, traced) is not None:
                runs = 0.0
            if runs is not None and runs < 1:
                for pipe_name, count in counts.items():
                    total[pipe_name] -= count * (1 - runs)
        for loop, weight in zip(self.loops, self.weights(trips)):
            for pipe_name, count in loop.counts.items():
                total[pipe_name] += count * weight
        return total

    @staticmethod
    def from_dict(values: dict) -> Profile:
        loops = tuple(Loop(**{**loop, "header": tuple(loop["header"]) if loop["header"] else None})
                      for loop in values["loops"])
        lines = tuple((tuple(line), counts) for line, counts in values.get("straight_lines", ()))
        return Profile(straight=values["straight"], loops=loops, straight_lines=lines)


def parse(text: str, kernel: str | None = None) -> list[Instruction]:
    """The instructions of one kernel function in `nvdisasm -c -gi` output (the first function when `kernel` is
    None), with each instruction's source lines (innermost and outermost of its inlining chain: `-gi` lists the
    chain from the inlined code out to the kernel's own line) and each branch's target."""
    sections = {}
    name = None
    for text_line in text.splitlines():
        if m := _FUNCTION.match(text_line):
            name = m.group("name")
            sections[name] = []
        elif name is not None:
            sections[name].append(text_line)
    if not sections:
        return []
    body = sections[kernel] if kernel in sections else next(iter(sections.values()))
    labels: dict[int, int] = {}  # label number -> address of the next instruction
    raw, pending, line, site, chain_open = [], [], None, None, False
    for text_line in body:
        if m := _LINE.match(text_line):
            source = (m.group("file"), int(m.group("line")))
            if not chain_open:  # the first line of a chain: the innermost
                line, chain_open = source, True
            if not m.group("inlined"):  # the chain's last line, "inlined at" nothing: the outermost
                site = source
        elif m := _LABEL.match(text_line):
            pending.append(int(m.group(1)))
        elif m := _INSTRUCTION.match(text_line):
            chain_open = False
            address = int(m.group("address"), 16)
            labels.update(dict.fromkeys(pending, address))
            pending = []
            raw.append((address, m.group("opcode"), m.group("operands").strip(), line, bool(m.group("predicate")),
                        site))
    instructions = []
    for address, opcode, operands, source, predicated, outermost in raw:
        target = None
        if opcode.split(".")[0] in ("BRA", "BRX", "JMP") and (m := _TARGET.search(operands)):
            target = labels.get(int(m.group(1)))
        instructions.append(Instruction(address, opcode, operands, source, target, predicated, outermost))
    return instructions


def _blocks(instructions: list[Instruction]) -> tuple[list[range], list[list[int]]]:
    """Basic blocks (instruction index ranges) and their successors: a branch's target, and the next block unless
    the block ends in an unconditional branch, EXIT or RET."""
    at = {ins.address: i for i, ins in enumerate(instructions)}
    leaders = {0}
    for i, ins in enumerate(instructions):
        base = ins.opcode.split(".")[0]
        if ins.target is not None and ins.target in at:
            leaders.add(at[ins.target])
        if base in _CONTROL:
            leaders.add(i + 1)
    starts = sorted(leader for leader in leaders if leader < len(instructions))
    blocks = [range(a, b) for a, b in zip(starts, [*starts[1:], len(instructions)])]
    block_of = {block.start: k for k, block in enumerate(blocks)}
    successors = []
    for k, block in enumerate(blocks):
        last = instructions[block[-1]]
        base = last.opcode.split(".")[0]
        found = [block_of[at[last.target]]] if last.target is not None and last.target in at else []
        ends = base in ("EXIT", "RET", "BRA", "JMP") and not last.predicated
        if not ends and k + 1 < len(blocks):
            found.append(k + 1)
        successors.append(found)
    return blocks, successors


def _dominators(successors: list[list[int]]) -> tuple[list[int], list[int], dict[int, list[int]]]:
    """(immediate dominator of each block reachable from block 0, -1 elsewhere; reverse postorder; the reachable
    predecessors of each block reachable), by Cooper, Harvey and Kennedy's iterative algorithm."""
    order, seen, stack = [], {0}, [(0, iter(successors[0]))]
    while stack:
        node, children = stack[-1]
        child = next(children, None)
        if child is None:
            order.append(node)
            stack.pop()
        elif child not in seen:
            seen.add(child)
            stack.append((child, iter(successors[child])))
    order.reverse()
    rank = {node: i for i, node in enumerate(order)}
    predecessors: dict[int, list[int]] = {node: [] for node in order}
    for node in order:
        for child in successors[node]:
            predecessors[child].append(node)
    idom = [-1] * len(successors)
    idom[0] = 0
    changed = True
    while changed:
        changed = False
        for node in order[1:]:
            ready = [p for p in predecessors[node] if idom[p] >= 0]
            new = ready[0]
            for other in ready[1:]:
                a, b = new, other
                while a != b:
                    while rank[a] > rank[b]:
                        a = idom[a]
                    while rank[b] > rank[a]:
                        b = idom[b]
                new = a
            if idom[node] != new:
                idom[node], changed = new, True
    return idom, order, predecessors


def _dominates(idom: list[int], a: int, b: int) -> bool:
    while b != a and b != 0:
        b = idom[b]
    return b == a


def count(instructions: list[Instruction], warp_share=None) -> Profile:
    """Per-pipe counts outside loops and per loop trip (nested loops excluded). Loops are natural loops: a back
    edge is a branch to a block that dominates it, and its loop is every block that reaches the branch without
    passing the header (so code ptxas lays out of line, a barrier's retry path, stays in its own loop). Code
    that cannot be reached from the entry (the self-branch after EXIT) is not counted.
    Warp-specialized roles: `warp_share(instruction)` (from the source's role branches, `warp_shares`) gives the
    share of a CTA's warps that run each instruction, which it counts for in the pipes (events, the barriers and
    global phases of the latency term, count whole: a role's round trips are the CTA's). Without it, or where the
    source has no role branch, roles come from the control flow: sibling loops neither of which reaches the other
    lie on exclusive paths (a producer's loop, a consumer's), and a loop gets an equal share of the warps with the
    most loops it is exclusive with that are exclusive with one another (loops before or after the roles, which
    every path reaches, keep them all)."""
    empty = dict.fromkeys((*PIPES, *EVENTS), 0)
    if not instructions:
        return Profile(dict(empty))
    blocks, successors = _blocks(instructions)
    idom, reachable, predecessors = _dominators(successors)
    bodies: dict[int, set] = {}  # header block -> loop blocks
    latch: dict[int, int] = {}  # header block -> its last back-edge block
    for k in reachable:
        for header in successors[k]:
            if _dominates(idom, header, k):
                body, work = bodies.setdefault(header, {header}), [k]
                while work:
                    node = work.pop()
                    if node not in body:
                        body.add(node)
                        work += predecessors[node]
                latch[header] = max(latch.get(header, k), k)
    headers = list(bodies)
    parent_of = {h: min((g for g in headers if g != h and h in bodies[g]), key=lambda g: len(bodies[g]), default=None)
                 for h in headers}

    def depth(h):
        return 0 if parent_of[h] is None else 1 + depth(parent_of[h])

    headers.sort(key=lambda h: (depth(h), blocks[h].start))
    index = {h: i for i, h in enumerate(headers)}
    counts = [dict(empty) for _ in headers]
    straight = dict(empty)
    innermost = {}
    for h in sorted(headers, key=lambda g: -len(bodies[g])):  # smaller loops overwrite the loops around them
        innermost.update(dict.fromkeys(bodies[h], index[h]))
    pending: dict = {}  # region (loop index, -1 outside loops) -> a blocking global load since its last barrier
    by_line: dict = {}  # straight-line counts by source line
    roles_in_source = False
    for k in sorted(reachable, key=lambda k: blocks[k].start):
        region = innermost.get(k, -1)
        counted = counts[region] if region >= 0 else straight
        for i in blocks[k]:
            ins = instructions[i]
            if ins.opcode == "NOP":
                continue
            share = 1.0 if warp_share is None else warp_share(ins)
            roles_in_source |= share < 1.0
            counted[pipe(ins.opcode)] += share
            counted["local_bytes"] += share * local_bytes(ins.opcode)
            line_counts = by_line.setdefault(ins.site, dict(empty)) if region < 0 and ins.site else None
            if line_counts is not None:
                line_counts[pipe(ins.opcode)] += share
                line_counts["local_bytes"] += share * local_bytes(ins.opcode)
            if (event := _EVENT.get(ins.opcode.split(".")[0])) is not None:
                counted[event] += 1
                if line_counts is not None:
                    line_counts[event] += 1
            if event == "global_load":
                outer = region
                while outer >= 0:  # a loop streaming global memory makes a phase of the body around it too
                    pending[outer] = True
                    outer = index.get(parent_of[headers[outer]], -1) if parent_of[headers[outer]] is not None else -1
                pending[-1] = True
            elif event == "barrier" and pending.get(region):
                counted["global_phase"] += 1
                if line_counts is not None:
                    line_counts["global_phase"] += 1
                pending[region] = False
    reaches = {h: _reachable(successors, h) for h in headers}

    def exclusive(h, g):
        return g != h and parent_of[g] == parent_of[h] and g not in reaches[h] and h not in reaches[g]

    def alternatives(h):  # h and a greedy set of siblings exclusive with it and with one another
        chosen = [h]
        for g in headers:
            if all(exclusive(c, g) for c in chosen):
                chosen.append(g)
        return len(chosen)

    loops = []
    for h in headers:
        branch = instructions[blocks[latch[h]][-1]]
        parent = -1 if parent_of[h] is None else index[parent_of[h]]
        loops.append(Loop(instructions[blocks[h].start].address, branch.address, parent, counts[index[h]],
                          branch.line, share=1.0 if roles_in_source else 1.0 / alternatives(h)))
    return Profile(straight, tuple(loops), tuple(by_line.items()))


def _reachable(successors: list[list[int]], start: int) -> set:
    found, work = set(), [start]
    while work:
        node = work.pop()
        if node not in found:
            found.add(node)
            work += successors[node]
    return found


def trips(profile: Profile, header_counts: dict, sizes: dict | None = None) -> tuple[list[float], list[bool]]:
    """(trips per CTA of each loop of `profile`, whether each was known), from how often each source loop header ran
    per CTA
    (`header_counts`: (file, line) -> executions, as a tracer sees them: a header runs once per trip and once
    more per entry, when the loop ends), else from a CUDA C header's bounds evaluated with `sizes` (name ->
    value: `for (int k = 0; k < ((N + 63) >> 6); ++k)`). A loop entered e times per CTA (its parent's trips, 1 at
    the top level) that ran h header executions made h - e trips; loops that share a header (the copies nvcc makes
    of one source loop when it unswitches a condition the loop does not change: alternatives) share its trips. A
    loop with neither whose bound reads data but is clamped by a side the sizes give (`for_bound`) takes that
    side's trips, an upper bound; any other (no line info, bounds that read other variables) is counted as one
    trip per entry. Neither is known."""
    found: list[float] = []
    known: list[bool] = []
    sharing: dict = {}
    for loop in profile.loops:
        sharing[loop.header] = sharing.get(loop.header, 0) + 1
    for loop in profile.loops:
        entries = found[loop.parent] if loop.parent >= 0 else 1.0
        executions = header_executions(loop.header, header_counts)
        if executions is None:
            extent = for_extent(loop.header_text, sizes or {})
            bound = for_bound(loop.header_text, sizes or {}) if extent is None else extent
            found.append(entries * (1 if bound is None else bound / sharing[loop.header]))
            known.append(extent is not None)
        else:
            share = executions / sharing[loop.header]
            found.append(max(share - entries, share / 2))
            known.append(True)
    return found, known


def header_executions(header: tuple[str, int] | None, header_counts: dict) -> float | None:
    """How often the source line `header` (file, line) ran, from `header_counts` ((file, line) -> executions);
    None if it did not. A build can name its files where they were when it was first compiled (Triton's cache
    keys a kernel on its source, not its path), so a file seen under another path counts as the same file when
    the paths end alike: the traced file that shares the longest tail of path components with it, at least its
    name."""
    if header is None or header in header_counts:
        return header_counts.get(header)
    file, line = header
    tail = Path(file).parts[::-1]
    best, best_shared = None, 0
    for (other, other_line), executions in header_counts.items():
        if other_line != line:
            continue
        shared = next((i for i, (a, b) in enumerate(zip(tail, Path(other).parts[::-1])) if a != b),
                      min(len(tail), len(Path(other).parts)))
        if shared > best_shared:
            best, best_shared = executions, shared
    return best


_FOR = re.compile(r"^\s*for\s*\(\s*(?:int|int64_t|long|unsigned)?\s*(?P<var>\w+)\s*=\s*(?P<start>[^;]+);\s*(?P=var)\s*<"
                  r"\s*(?P<end>[^;]+);\s*(?:\+\+(?P=var)|(?P=var)\+\+|(?P=var)\s*\+=\s*(?P<step>\d+))\s*\)")
_CAST = re.compile(r"\(\s*(?:int|int64_t|long|uint|unsigned|int32_t|uint32_t|uint64_t)\s*\)")
_SAFE = re.compile(r"^[\w\s+\-*/%<>&|^(),]*$")


def for_extent(header: str, sizes: dict) -> float | None:
    """Trips per entry of a CUDA C `for (int v = A; v < B; ++v)` (or `v += S`) header whose bounds are integer
    arithmetic of `sizes` (name -> value; "blockIdx.x" and friends -> the grid's extent, over which a bound that
    reads them is averaged); None for any other form."""
    m = _FOR.match(header)
    if m is None:
        return None
    axes = "xyz"
    names = {name: value for name, value in sizes.items() if not name.startswith("blockIdx.")}
    for i, axis in enumerate(axes):
        extent = sizes.get(f"blockIdx.{axis}", 1)
        names[f"blockIdx_{axis}"] = np.arange(extent).reshape([-1 if j == i else 1 for j in range(3)])
    values = []
    for bound in (m.group("start"), m.group("end")):
        text = _CAST.sub("", bound).replace("/", "//").replace("blockIdx.", "blockIdx_")
        if not _SAFE.match(text) or any(name not in names and name not in ("min", "max")
                                        for name in re.findall(r"[A-Za-z_]\w*", text)):
            return None
        try:
            values.append(eval(text, {"__builtins__": {}, "min": np.minimum, "max": np.maximum}, names))  # noqa: S307
        except (ArithmeticError, SyntaxError, TypeError):
            return None
    step = int(m.group("step") or 1)
    trips = np.maximum(0, -(-(np.asarray(values[1]) - np.asarray(values[0])) // step))
    grid = np.broadcast_to(trips, [sizes.get(f"blockIdx.{axis}", 1) for axis in axes])
    return float(grid.mean())


def for_bound(header: str, sizes: dict) -> float | None:
    """The most trips per entry of a `for (int v = 0; v < min(A, B); ++v)` header whose bound reads data but is
    clamped by a side that `for_extent` evaluates (TileLang's pipelined loop over the tiles that meet some row's
    range, at most the block's tiles); None for any other form. An upper bound, as the traffic count takes it."""
    m = _FOR.match(header)
    if m is None or m.group("start").strip() != "0" or m.group("step"):
        return None
    end = _CAST.sub("", m.group("end")).strip()
    while end.startswith("(") and _closing(end, 0) == len(end) - 1:
        end = end[1:-1].strip()
    if not end.startswith("min("):
        return None
    depth, comma = 0, None
    for i, ch in enumerate(end[4:-1], 4):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            comma = i
    if comma is None or _closing(end, 3) != len(end) - 1:
        return None
    sides = (for_extent(f"for (int {m.group('var')} = 0; {m.group('var')} < {side.strip()}; ++{m.group('var')})",
                        sizes) for side in (end[4:comma], end[comma + 1:-1]))
    known = [side for side in sides if side is not None]
    return min(known) if known else None


def _closing(text: str, opening: int) -> int:
    """Index of the parenthesis closing the one at `opening`."""
    depth = 0
    for i in range(opening, len(text)):
        depth += text[i] == "("
        depth -= text[i] == ")"
        if depth == 0:
            return i
    return -1


_LOCAL = re.compile(r"^\s*(?:const\s+)?int\s+(?P<name>\w+)\s*=\s*(?P<value>.+);\s*$")


def with_locals(header: str, before: list[str]) -> str:
    """A loop header whose bound is a local `int` named alone (`i < count`) with that local's value written in,
    from its definition among the lines `before` it (TileLang's CUDA C names a pipelined loop's extent). A local
    assigned again after its definition (a `T.alloc_var`: `int tiles = 0;` then `tiles = ...;`) keeps its name:
    its value is data, which the traffic count may give among the sizes."""
    m = _FOR.match(header)
    if m is None or not re.fullmatch(r"[A-Za-z_]\w*", m.group("end").strip()):
        return header
    name = m.group("end").strip()
    assigned = re.compile(rf"^\s*{name}\s*=[^=]")
    for line in reversed(before):
        if assigned.match(line):
            return header
        local = _LOCAL.match(line)
        if local and local.group("name") == name:
            return header.replace(f"< {name};", f"< ({local.group('value')});", 1)
    return header


@functools.cache
def nvdisasm_path() -> str:
    """The nvdisasm Triton's NVIDIA backend ships (it runs without a GPU), else one on PATH."""
    import shutil

    try:
        import triton.backends.nvidia as nvidia

        bundled = os.path.join(os.path.dirname(nvidia.__file__), "bin", "nvdisasm")
        if os.path.exists(bundled):
            return bundled
    except ImportError:
        pass
    found = shutil.which("nvdisasm")
    if found is None:
        raise FileNotFoundError("nvdisasm not found (Triton's NVIDIA backend ships one)")
    return found


def no_unroll(ptx: str) -> str:
    """`ptx` with loop unrolling off for the whole module (PTX ISA: module-scope `.pragma "nounroll"`)."""
    m = re.search(r"^\s*\.address_size\s+\d+\s*$", ptx, re.M)
    if m is None:
        raise ValueError("PTX without an .address_size directive")
    return ptx[:m.end()] + '\n.pragma "nounroll";\n' + ptx[m.end():]


_LAUNCH_BOUNDS = re.compile(r"__launch_bounds__\(\s*(\d+)")
_ELSE = re.compile(r"^\s*\}\s*else\s*\{\s*$")
_THREAD_BRANCH = re.compile(r"^\s*if\s*\(\(\(int\)threadIdx\.x\)\s*(?P<op><|>=)\s*(?P<bound>\d+)\)\s*\{\s*$")


def warp_shares(source: str) -> dict:
    """Line -> share of the CTA's warps that run it, for the lines inside role branches of generated CUDA C
    (TileLang's warp specialization: `if (((int)threadIdx.x) < N) { .. } else { .. }`, nested or not): a branch
    over threads [lo, hi) runs on the warps that hold any of them, out of the `__launch_bounds__` threads'."""
    bounds = _LAUNCH_BOUNDS.search(source)
    if bounds is None:
        return {}
    threads = int(bounds.group(1))
    warps = -(-threads // 32)
    current = (0, threads)
    stack: list = []  # per open brace: (the range around it, the else-branch's range for a role branch or None)
    shares = {}
    for number, line in enumerate(source.splitlines(), start=1):
        if current != (0, threads):
            lo, hi = current
            shares[number] = max(0, -(-hi // 32) - lo // 32) / warps if hi > lo else 0.0
        branch = _THREAD_BRANCH.match(line)
        if branch:
            lo, hi = current
            bound = int(branch.group("bound"))
            below, above = (lo, min(hi, bound)), (max(lo, bound), hi)
            taken, other = (below, above) if branch.group("op") == "<" else (above, below)
            stack.append((current, other))
            current = taken
            continue
        if _ELSE.match(line) and stack and stack[-1][1] is not None:
            outer, other = stack.pop()
            stack.append((outer, None))
            current = other
            continue
        for char in line:
            if char == "{":
                stack.append((current, None))
            elif char == "}" and stack:
                current = stack.pop()[0]
    return shares


def profile(ptx: str, assembler, sources: dict | None = None) -> Profile:
    """The issue profile of `ptx`: assembled by `assembler` (kernels.build.Assembler: PTX -> (cubin, log), with
    line info) with unrolling off, then disassembled. `sources` (path -> text) gives each loop's header text and
    the warp roles (`warp_shares`), for sources that are gone when the model runs (TileLang's generated CUDA C)."""
    cubin_bytes, _ = assembler(no_unroll(ptx))
    with tempfile.TemporaryDirectory(prefix="flashkern-sass-") as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        Path(cubin).write_bytes(cubin_bytes)
        listing = subprocess.run([nvdisasm_path(), "-c", "-gi", cubin], capture_output=True, text=True)
        if listing.returncode != 0:
            raise RuntimeError("nvdisasm failed:\n" + listing.stderr[-4000:])
    kernel = re.search(r"^\s*\.(?:visible\s+)?\.entry\s+(\w+)", ptx, re.M)
    roles = {path: warp_shares(text) for path, text in (sources or {}).items()}

    def warp_share(instruction):
        site = instruction.site
        return roles.get(site[0], {}).get(site[1], 1.0) if site else 1.0

    counted = count(parse(listing.stdout, kernel.group(1) if kernel else None), warp_share)
    lines = {path: text.splitlines() for path, text in (sources or {}).items()}

    def text_of(header):
        source = lines.get(header[0]) if header else None
        if not source or not 0 < header[1] <= len(source):
            return ""
        return with_locals(source[header[1] - 1].strip(), source[:header[1] - 1])

    return dataclasses.replace(counted, loops=tuple(dataclasses.replace(loop, header_text=text_of(loop.header))
                                                    for loop in counted.loops))
