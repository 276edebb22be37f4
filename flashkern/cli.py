"""The flashkern command line.

  flashkern list                         operators, and which implementations run here (and why not)
  flashkern bench [OP ...] [--preset P]  time every backend at a preset's shapes (default: smoke)
  flashkern compile-check [OP ...]       build every implementation for sm_90a (default + sampled configs)
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from flashkern import device as devices
from flashkern import registry

console = Console(width=None if sys.stdout.isatty() else 160)


def _op_names(names: list[str]) -> list[str]:
    known = registry.operators()
    for name in names:
        if name not in known:
            raise SystemExit(f"unknown operator {name!r}; known: {', '.join(sorted(known))}")
    return names or sorted(known)


def _preset(op_names: list[str], preset: str) -> str:
    for name in op_names:
        presets = registry.get(name).presets
        if preset not in presets:
            raise SystemExit(f"{name} has no preset {preset!r}; it has: {', '.join(presets)}")
    return preset


def cmd_list(args) -> int:
    from flashkern.dispatch import auto_choice

    info = devices.info()
    console.print(f"device: {info.describe()}")
    table = Table(show_lines=False)
    for col in ("operator", "backend", "runs here", "how / why not"):
        table.add_column(col)
    for name, op in sorted(registry.operators().items()):
        auto = auto_choice(op, info)
        table.add_row(name, "reference", "yes", f"PyTorch; {op.summary}" + ("  [auto]" if auto is None else ""))
        for impl in op.implementations:
            reason = impl.unavailable(info)
            how = impl.kernel.cpu_mode if info.kind == "cpu" else f"native CUDA, sm_{info.capability[0]}{info.capability[1]}"
            mark = "  [auto]" if auto is impl else ""
            table.add_row("", impl.name, "no" if reason else "yes", (reason or how) + mark)
        table.add_row("", "presets", "", ", ".join(f"{k} ({len(v)})" for k, v in op.presets.items()), end_section=True)
    console.print(table)
    return 0


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}" if seconds < 1e-2 else f"{seconds * 1e6:,.0f}"


def cmd_bench(args) -> int:
    from flashkern.bench import bench

    names = _op_names(args.ops)
    preset = _preset(names, args.preset)
    info = devices.info(args.device)
    console.print(f"bench on {info.describe()}, preset {preset!r}: median time per call in µs (GB/s of the bytes "
                  "the operator must move); * = Triton interpreter, a correctness path")
    with console.status("timing..."):
        rows = bench(names, preset, args.device, budget=args.budget)
    failed = False
    for name in names:
        op = registry.get(name)
        table = Table(title=name, title_justify="left")
        table.add_column("shape")
        table.add_column("moves", justify="right")
        for backend in op.backends:
            table.add_column(backend, justify="right")
        table.add_column("best vs reference", justify="right")
        for problem in op.presets[preset]:
            cells = {r.backend: r for r in rows if r.op == name and r.problem == problem}
            ref_time = cells["reference"].timing.median
            row = [problem.key, _size(cells["reference"].bytes)]
            best = None
            for backend in op.backends:
                r = cells[backend]
                if r.timing is None:
                    failed |= r.status.startswith("MISMATCH")
                    row.append(f"[red]{r.status}[/red]" if r.status.startswith("MISMATCH") else "—")
                    continue
                star = "*" if backend == "triton" and info.kind == "cpu" else ""
                row.append(f"{_us(r.timing.median)}{star} ({r.gbps:.2f})")
                if backend != "reference" and not star and (best is None or r.timing.median < best[1]):
                    best = (backend, r.timing.median)
            row.append(f"{best[0]} {ref_time / best[1]:.2f}x" if best else "—")
            table.add_row(*row)
        console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(op=r.op, shape=r.problem.key, backend=r.backend, status=r.status, bytes=r.bytes,
                            median_s=r.timing.median if r.timing else None,
                            min_s=r.timing.low if r.timing else None, max_s=r.timing.high if r.timing else None,
                            reps=r.timing.reps if r.timing else None) for r in rows], f, indent=1)
    return 1 if failed else 0


def cmd_compile_check(args) -> int:
    from flashkern import compile_check

    names = _op_names(args.ops)
    jobs = compile_check.plan(names, _preset(names, args.preset), args.sample, args.seed)
    with Progress(TextColumn("sm_90a builds"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True) as progress:
        task = progress.add_task("build", total=len(jobs))
        results = compile_check.run(jobs, args.jobs, on_result=lambda r: progress.advance(task))
    table = Table(title="sm_90a build check (ptxas figures per thread; smem per block)", title_justify="left")
    for col in ("operator", "impl", "problem", "config", "regs", "spills B", "smem KiB", "threads", "wgmma", "s",
                "result"):
        table.add_column(col, justify="right" if col in ("regs", "spills B", "smem KiB", "threads", "s") else "left")
    for r in results:
        job, rep = r.job, r.report
        config = ", ".join(f"{k}={v}" for k, v in r.config.items()) + (" (default)" if job.default else "")
        result = "ok" if r.ok else ("[yellow]skipped: " + r.error + "[/yellow]" if r.skipped else "[red]FAILED[/red]")
        if rep:
            figures = [str(rep.registers), str(rep.spills), f"{rep.smem / 1024:.1f}", str(rep.threads),
                       "yes" if rep.wgmma else "no"]
        else:
            figures = ["—"] * 5
        table.add_row(job.op, job.impl, job.problem.key, config, *figures, f"{r.seconds:.1f}", result)
    console.print(table)
    for r in results:
        if not r.ok and not r.skipped:
            console.print(f"[red]{r.job.op}/{r.job.impl} {r.config}[/red]\n{r.error}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(op=r.job.op, impl=r.job.impl, problem=r.job.problem.key, config=r.config,
                            default=r.job.default, ok=r.ok, skipped=r.skipped, error=r.error, seconds=r.seconds,
                            **(r.report.__dict__ if r.report else {})) for r in results], f, indent=1)
    return 0 if all(r.ok or r.skipped for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashkern", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="operators and where their implementations run")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("bench", help="time every backend at a preset's shapes")
    p.add_argument("ops", nargs="*", help="operators (default: all)")
    p.add_argument("--preset", default="smoke", help="shape preset (default: smoke)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--budget", type=float, default=0.3, help="seconds of timing per cell (default: 0.3)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("compile-check", help="build every implementation for sm_90a and report resources")
    p.add_argument("ops", nargs="*", help="operators (default: all)")
    p.add_argument("--preset", default="smoke", help="preset whose kernel specializations are built")
    p.add_argument("--sample", type=int, default=2, help="sampled configs per implementation besides the default")
    p.add_argument("--seed", type=int, default=0, help="seed of the config sample")
    p.add_argument("--jobs", type=int, default=None, help="parallel build processes (default: CPU count)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.set_defaults(func=cmd_compile_check)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
