"""The flashkern command line's verbs (flashkern_cli parses their arguments; `flashkern --help` lists them)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from flashkern import device as devices
from flashkern import registry
from flashkern.autotune.store import StoreError


console = Console(width=None if sys.stdout.isatty() else 160, soft_wrap=True)  # tables fit; lines never hard-wrap
AUTO_MARK = escape("  [auto]")  # rich would read a bare [auto] as markup and drop it


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
    from flashkern.dispatch import rule_choice

    info = devices.info()
    console.print(f"device: {info.describe()}")
    table = Table(show_lines=False)
    for col in ("operator", "backend", "runs here", "how / why not"):
        table.add_column(col)
    for name, op in sorted(registry.operators().items()):
        auto = rule_choice(op, info)
        table.add_row(name, "reference", "yes", f"PyTorch; {op.summary}" + (AUTO_MARK if auto is None else ""))
        for impl in op.implementations:
            reason = impl.unavailable(info)
            how = impl.kernel.cpu_mode if info.kind == "cpu" else f"native CUDA, sm_{info.capability[0]}{info.capability[1]}"
            mark = AUTO_MARK if auto is impl else ""
            table.add_row("", impl.name, "no" if reason else "yes", (reason or how) + mark)
        table.add_row("", "presets", "", ", ".join(f"{k} ({len(v)})" for k, v in op.presets.items()), end_section=True)
    console.print(table)
    console.print(escape("[auto] marks the default rule for untuned shapes; tuned shapes follow `flashkern table OP`, "
                         "and `flashkern explain OP` says what auto runs per shape and why."))
    return 0


def cmd_explain(args) -> int:
    from flashkern.autotune import store as stores
    from flashkern.dispatch import explain, reload_tables

    if args.db:  # the tables auto reads come from the default store: point it there
        if not os.path.exists(args.db):
            raise SystemExit(f"no store at {args.db}: `flashkern tune` makes one, --db names another")
        os.environ[stores.ENV_VAR] = args.db
        reload_tables()
    info = devices.info(args.device)
    op = registry.get(_op_names([args.op])[0])
    table = Table(title=f"{op.name}: what backend='auto' runs on {info.describe()}")
    for col in ("shape", "backend", "config", "why"):
        table.add_column(col)
    for problem in _problems(op, args):
        backend, config, why = explain(op, problem, info)
        table.add_row(problem.key, backend, json.dumps(config) if config else "", why)
    console.print(table)
    return 0


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}" if seconds < 1e-2 else f"{seconds * 1e6:,.0f}"


def _modelled(records: dict, op, problem_key: str) -> str:
    """The saved H200 model's time and roofline fraction per kernel for one shape, e.g. 'triton 12 (45%)'."""
    found = [(impl.name, records.get((op.name, impl.name, problem_key))) for impl in op.implementations]
    return ", ".join(f"{name} {_us(r['model_seconds'])} ({r['roofline_fraction']:.0%})" for name, r in found if r) or "—"


def _fastest(medians: dict[str, float]) -> str:
    """The fastest backend by median time, the reference included; a kernel with its speedup over the reference."""
    fastest = min(medians, key=medians.get)
    return fastest if fastest == "reference" else f"{fastest} {medians['reference'] / medians[fastest]:.2f}x ref"


def cmd_bench(args) -> int:
    from flashkern import model
    from flashkern.bench import bench

    preset = args.preset
    names = _with_preset(_op_names(args.ops), preset)
    records = model.current_records()
    info = devices.info(args.device)
    backends = args.backends
    console.print(f"bench on {info.describe()}, preset {preset!r}: median time per call in µs ± IQR / median (GB/s of "
                  "the bytes the operator must move); interpreted Triton (CPU) is checked, not timed, unless "
                  "--time-interpreted (then marked *); on CUDA, device time from CUDA graphs (host time included "
                  "where a call cannot be captured: marked eager)")
    total = sum(len(_problems(registry.get(name), args)) * len(registry.get(name).backends) for name in names)
    with Progress(TextColumn("bench"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("bench", total=total)
        rows = bench(names, lambda op: _problems(op, args), args.device, budget=args.budget, backends=backends,
                     threads=args.threads, time_interpreted=args.time_interpreted,
                     on_row=lambda row: progress.advance(task))
    failed = False
    for name in names:
        op = registry.get(name)
        table = Table(title=name, title_justify="left")
        table.add_column("shape", no_wrap=True, min_width=max(len(p.key) for p in _problems(op, args)))
        table.add_column("moves", justify="right")
        for backend in op.backends:
            table.add_column(backend, justify="right")
        table.add_column("fastest", justify="right")
        table.add_column("H200 model µs (roofline)", justify="right")
        for problem in _problems(op, args):
            cells = {r.backend: r for r in rows if r.op == name and r.problem == problem}
            row = [problem.key, _size(cells["reference"].bytes)]
            timed = {}
            for backend in op.backends:
                r = cells[backend]
                if r.timing is None:
                    failed |= r.status.startswith("MISMATCH")
                    row.append(f"[red]{r.status}[/red]" if r.status.startswith("MISMATCH") else
                               "checked" if r.status == "checked" else "—")
                    continue
                star = "*" if backend == "triton" and info.kind == "cpu" else ""
                eager = " eager" if info.kind == "cuda" and not r.timing.graphed else ""
                row.append(f"{_us(r.timing.median)}{star} ±{r.timing.spread:.0%} ({r.gbps:.2f}){eager}")
                if not star:  # interpreted Triton is a correctness path, never the fastest
                    timed[backend] = r.timing.median
            row.append(_fastest(timed))
            row.append(_modelled(records, op, problem.key))
            table.add_row(*row)
        console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(op=r.op, shape=r.problem.key, backend=r.backend, status=r.status, bytes=r.bytes,
                            median_s=r.timing.median if r.timing else None, iqr_s=r.timing.iqr if r.timing else None,
                            threads=r.timing.threads if r.timing else None,
                            min_s=r.timing.low if r.timing else None, max_s=r.timing.high if r.timing else None,
                            reps=r.timing.reps if r.timing else None) for r in rows], f, indent=1)
    return 1 if failed else 0


def cmd_compile_check(args) -> int:
    from flashkern import compile_check

    names = _with_preset(_op_names(args.ops), args.preset)
    jobs = [job for job in compile_check.plan(names, args.preset, args.sample, args.seed)
            if args.impl is None or job.impl == args.impl]
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
        if rep and rep.hazards:
            result = f"[red]{len(rep.hazards)} GPU hazard{'s' if len(rep.hazards) > 1 else ''}[/red]"
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
        for hazard in r.report.hazards if r.report else ():  # the GPU lint (flashkern.kernels.gpu_lint)
            console.print(f"[red]{r.job.op}/{r.job.impl} {r.job.problem.key} {r.config}[/red]: {hazard}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(op=r.job.op, impl=r.job.impl, problem=r.job.problem.key, config=r.config,
                            default=r.job.default, ok=r.ok, skipped=r.skipped, error=r.error, seconds=r.seconds,
                            **(dataclasses.asdict(r.report) if r.report else {})) for r in results], f, indent=1)
    return 0 if all((r.ok and not r.report.hazards) or r.skipped for r in results) else 1


def cmd_check(args) -> int:
    from pathlib import Path

    import torch

    from flashkern import check

    op = registry.get(_op_names([args.op])[0])
    if op.cases is None:
        raise SystemExit(f"{op.name} has no input strategies (Operator.cases) to check with")
    backends = [args.backend] if args.backend else [impl.name for impl in op.implementations]
    if args.config is not None and len(backends) != 1:
        raise SystemExit("--config needs --backend (a config belongs to one implementation)")
    if args.config is not None:
        if args.backend == "reference":
            raise SystemExit("--config: the reference has no tuning space")
        try:  # a config outside the space is a usage error, not a kernel failure to shrink
            op.implementation(args.backend).space.check_points(args.config)
        except (TypeError, ValueError) as exc:
            print(f"flashkern check: error: --config: {exc}", file=sys.stderr)
            return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    failed = False
    for backend in backends:
        with Progress(TextColumn(f"{op.name} {backend}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=console, transient=True) as progress:
            task = progress.add_task("check", total=args.examples)
            failure = check.run(op, backend, args.config, args.examples, args.seed, device,
                                on_example=lambda: progress.advance(task))
        if failure is None:
            console.print(f"{op.name} {backend}{' ' + json.dumps(args.config) if args.config else ''}: "
                          f"{args.examples} examples (seed {args.seed}) match the reference")
            continue
        failed = True
        console.print(f"[red]{op.name} {backend}: {type(failure.error).__name__}[/red]: "
                      f"{escape(str(failure.error)[:2000])}")
        console.print("shrunk case, reproduce with:\n")
        print(check.snippet(op, backend, args.config, failure.inputs, Path(args.save_dir)))
    return 1 if failed else 0


def _with_preset(op_names: list[str], preset: str) -> list[str]:
    """The operators that have `preset`; the others are named as skipped."""
    having = [name for name in op_names if preset in registry.get(name).presets]
    if not having:
        known = sorted({p for name in op_names for p in registry.get(name).presets})
        raise SystemExit(f"no operator here has preset {preset!r}; presets: {', '.join(known)}")
    skipped = sorted(set(op_names) - set(having))
    if skipped:
        console.print(f"no preset {preset!r}, skipped: {', '.join(skipped)}")
    return having


def _census_text(census) -> str:
    """Tensor cores, copy path, widest global load per thread, atomics: e.g. 'wgmma fp8, TMA, 16B'."""
    parts = [f"wgmma {census.mma_input}" if census.wgmma else f"mma {census.mma_input}" if census.mma_sync else "FMA",
             "TMA" if census.tma else "cp.async" if census.cp_async else "ld", f"{census.widest_load}B"]
    atomics = census.global_atomics + census.shared_atomics
    return ", ".join(parts + ([f"{atomics} atom"] if atomics else []))


def model_markdown(records: list[dict], command: str) -> str:
    """A saved model's default configs (Row.record()s) as Markdown: a summary per kernel, then a row per shape."""
    from flashkern.kernels.build import Census

    defaults = [r for r in records if r["default"]]
    device = next((r["device"] for r in defaults if "device" in r), "GPU")
    lines = [f"Predicted by a model of the {device}, not measured (`{command}`; flashkern.model). Kernel time "
             "excludes the launch; the roofline fraction is the operator's roof over the kernel time.", "",
             "| operator | impl | shapes | roofline fraction | kernel µs | bounds | bytes / minimum | census |",
             "|---|---|---:|---:|---:|---|---:|---|"]
    for op, impl in dict.fromkeys((r["op"], r["impl"]) for r in defaults):
        found = [r for r in defaults if (r["op"], r["impl"]) == (op, impl) and "model_seconds" in r]
        if not found:
            lines.append(f"| {op} | {impl} | 0 | not modelled | | | | |")
            continue
        fractions, times = [r["roofline_fraction"] for r in found], [r["kernel_seconds"] * 1e6 for r in found]
        census = Census.total(Census(**s["census"]) for s in found[-1]["stages"])
        bounds = ", ".join(dict.fromkeys(r["bound"] for r in found))
        lines.append(f"| {op} | {impl} | {len(found)} | {min(fractions):.0%} - {max(fractions):.0%} | "
                     f"{min(times):.1f} - {max(times):.1f} | {bounds} | {max(r['traffic_ratio'] for r in found):.2f} "
                     f"max | {_census_text(census)} |")
    lines += ["", "Per shape (launch: from the host / in a CUDA graph):", "",
              "| operator | impl | shape | kernel µs | bound | + launch µs | graph µs | roof µs | roofline | "
              "bytes / minimum | CTAs | census |",
              "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in defaults:
        if "model_seconds" not in r:
            lines.append(f"| {r['op']} | {r['impl']} | {r['problem']} | not modelled: {r['error'][:60]} |"
                         + " |" * 8)
            continue
        census = Census.total(Census(**s["census"]) for s in r["stages"])
        lines.append(f"| {r['op']} | {r['impl']} | {r['problem']} | {r['kernel_seconds'] * 1e6:.1f} | {r['bound']} | "
                     f"{r['model_seconds'] * 1e6:.1f} | {r['graph_seconds'] * 1e6:.1f} | {r['roof_seconds'] * 1e6:.2f} "
                     f"| {r['roofline_fraction']:.0%} | {r['traffic_ratio']:.2f} | "
                     f"{'+'.join(str(s['ctas']) for s in r['stages'])} | {_census_text(census)} |")
    return "\n".join(lines) + "\n"


def cmd_model(args) -> int:
    from flashkern import model

    device = model.DEVICES[args.device]
    names = _with_preset(_op_names(args.ops), args.preset)
    with Progress(TextColumn("model: builds, then traffic"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("model", total=None)
        rows = model.evaluate(names, args.preset, device, args.sample, args.seed, args.jobs,
                              on_step=lambda done, total: progress.update(task, completed=done, total=total))
    table = Table(title=f"{device.name} performance MODEL, not a measurement (flashkern.model; {args.preset} preset)",
                  title_justify="left")
    for col in ("operator", "impl", "problem", "config", "CTAs", "per SM", "fill", "MB moved", "x min", "census",
                "kernel us", "bound", "+launch us", "graph us", "roof us", "roofline"):
        table.add_column(col, justify="left" if col in ("operator", "impl", "problem", "config", "census") else "right")
    for r in rows:
        config = "default" if r.default else ", ".join(f"{k}={v}" for k, v in r.config.items())
        p = r.prediction
        if p is None:
            table.add_row(r.op, r.impl, r.problem.key, config, *["—"] * 5, "[red]not modelled[/red]", *["—"] * 6)
            continue
        widest = max(p.stages, key=lambda s: s.traffic.ctas)
        table.add_row(r.op, r.impl, r.problem.key, config, "+".join(str(s.traffic.ctas) for s in p.stages),
                      f"{widest.occupancy.ctas_per_sm} ({widest.occupancy.limiter})", f"{widest.fill:.0%}",
                      f"{p.traffic / 1e6:.2f}", f"{p.traffic_ratio:.2f}", _census_text(p.census),
                      f"{p.kernel_seconds * 1e6:.1f}", p.bound, f"{p.seconds * 1e6:.1f}", f"{p.graph_seconds * 1e6:.1f}",
                      f"{p.roof_seconds * 1e6:.2f}", f"{p.roofline_fraction:.1%}")
    console.print(table)
    for r in rows:
        if r.prediction is None:
            console.print(f"[red]{r.op}/{r.impl} {escape(r.problem.key)}[/red]: {escape(r.error)}")
    console.print(f"model: kernel time = the memory side (HBM: L2 misses at {model.MEMORY_EFFICIENCY:.0%} of peak; "
                  f"L2; spills) and the compute side (tensor: {model.MATH_EFFICIENCY:.0%} of the peak of the "
                  f"arithmetic built; issue: the SASS per pipe over the busy sub-partitions at their warps' issue "
                  f"efficiency), all over the SM fill, overlapping as a {model.OVERLAP_EXPONENT:g}-norm, no less than "
                  f"latency (dependent global phases x a round trip); then a launch: "
                  f"{model.LAUNCH_SECONDS * 1e6:.1f} us from the host, "
                  f"{model.GRAPH_LAUNCH_SECONDS * 1e6:.1f} us in a CUDA graph; roof = the operator's bytes at HBM peak "
                  f"or flops at its arithmetic's peak, no launch; device figures: {device.sources}")
    records = [r.record() for r in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if args.markdown:
        command = " ".join(["flashkern model", *args.ops, "--preset", args.preset, "--device", args.device,
                            "--markdown", args.markdown] + (["--json", args.json] if args.json else []))
        with open(args.markdown, "w") as f:
            f.write(model_markdown(records, command))
    return 0 if all(r.prediction for r in rows) else 1


def _store(args, create: bool = False):
    """The store --db names (else the default one). A verb that only reads (create False) refuses a path where no
    store is, naming it, instead of creating an empty store there and finding nothing in it."""
    from flashkern.autotune import store as stores

    path = stores.Path(args.db) if args.db else stores.default_path()
    if not create and not path.exists():
        raise SystemExit(f"no store at {path}: `flashkern tune` makes one, --db names another")
    return stores.Store(path)


def _problems(op, args) -> list:
    """The preset's problems, or with --shapes, those sizes for each of the preset's specializations."""
    problems = list(op.presets[_preset([op.name], args.preset)])
    if args.shapes:
        specs = {}
        for p in problems:
            specs.setdefault(p.specialization(), p)
        count = len(problems[0].sizes)
        for shape in args.shapes:
            if len(shape) != count:
                raise SystemExit(f"--shapes: {op.name} takes {count} size(s) per shape, got {'x'.join(map(str, shape))}")
        problems = [p.with_sizes(s) for p in specs.values() for s in args.shapes]
    return problems


def cmd_tune(args) -> int:
    from flashkern.autotune import ray_sweep
    from flashkern.autotune.tuner import Tuner
    from flashkern.dispatch import reload_tables

    sweep = {name: _problems(registry.get(name), args) for name in _op_names(args.ops)}
    with _store(args, create=True) as store, Progress(TextColumn("{task.description}"), BarColumn(),
                                         TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                         TextColumn("ETA"), TimeRemainingColumn(), console=console) as progress:
        task = progress.add_task(f"tuning {', '.join(sweep)}", total=None)

        def report(total=None, advance=0, description=None):
            if total is not None:  # a new sweep (one per operator without Ray): counted from zero
                progress.reset(task, total=total, description=description or None)
            progress.update(task, advance=advance)

        if args.ray:
            summaries = ray_sweep.tune(store, sweep, args.ray, args.device, budget=args.budget,
                                       max_configs=args.max_configs, seed=args.seed, threads=args.threads,
                                       progress=report)
        else:
            tuner = Tuner(store, args.device, budget=args.budget, max_configs=args.max_configs, workers=args.jobs,
                          seed=args.seed, progress=report, threads=args.threads)
            summaries = {name: tuner.tune(name, problems) for name, problems in sweep.items()}
        for name, summary in summaries.items():
            console.print(f"{name}: store {store.path}: {summary.measured} new results, {summary.reused} reused, "
                          f"{summary.built} builds, {summary.decided} new decisions")
    reload_tables()
    for name in sweep:
        cmd_table(argparse.Namespace(**{**vars(args), "op": name, "ray": None}))
    return 0


def cmd_table(args) -> int:
    from pathlib import Path

    from flashkern.autotune import table as tables

    op = registry.get(_op_names([args.op])[0])
    info = devices.info(args.device)
    text, import_file = None, getattr(args, "import_file", None)  # tune shows its table through here: no such flags
    if import_file:
        try:
            text = Path(import_file).read_text()
        except OSError as exc:
            raise SystemExit(f"--import: cannot read {import_file}: {exc.strerror}") from None
    with _store(args, create=text is not None) as store:
        if text is not None:
            try:
                count = tables.import_json(store, text)
            except ValueError as exc:
                raise SystemExit(f"--import: {import_file}: {exc}") from None
            console.print(f"imported {count} decisions into {store.path}")
        current = tables.current_decisions(store, info.key, op.name)
        stale = len(store.decisions(op.name, info.key)) - len(current)
        if getattr(args, "export", None):
            Path(args.export).write_text(tables.export_json(current, info.key))
            console.print(f"exported {len(current)} decisions to {args.export}")
    table = Table(title=f"{op.name}: backend='auto' on {info.describe()}; µs: the winner's median when decided (its "
                  "leaders re-timed together; `flashkern report` shows each backend's best time from the sweep)",
                  title_justify="left")
    for col in ("shape", "backend", "config", "µs", "why"):
        table.add_column(col, justify="right" if col == "µs" else "left")
    for d in sorted(current, key=lambda d: (d.spec, d.sizes)):
        table.add_row(d.shape, d.impl, d.config, _us(d.median), d.reason)
    console.print(table)
    console.print("untuned shapes: nearest tuned bucket of the same specialization, else the default rule"
                  + (f"; {stale} stale decisions (other versions) ignored" if stale else ""))
    return 0


def _decided(decision, best: dict) -> str:
    """The auto column of a report: the decided backend, its re-timed median, and its config where that is not the
    backend's best in the sweep (the decision keeps the simplest of configs within noise)."""
    swept = best.get(decision.impl)
    other = swept is not None and swept.key.config != decision.config
    return f"{decision.impl} {_us(decision.median)}" + (f" {decision.config}" if other else "")


def cmd_report(args) -> int:
    from flashkern import model
    from flashkern.autotune import report

    op = registry.get(_op_names([args.op])[0])
    records = model.current_records()
    info = devices.info(args.device)
    with _store(args) as store:
        shape_rows = report.rows(store, op, info.key)
        stale = report.stale_count(store, op, info.key)
    if stale:
        console.print(f"{stale} results measured with other versions of the code or libraries are kept but ignored")
    if not shape_rows:
        console.print(f"no current results for {op.name} on {info.describe()}: run `flashkern tune {op.name}` first")
        return 1
    bandwidth = info.mem_bandwidth
    table = Table(title=f"{op.name} on {info.describe()}: best config per backend in the sweep, median µs per call ± "
                  "IQR / median" + (f" (% of the {bandwidth / 1e9:.0f} GB/s memory roofline)" if bandwidth else "")
                  + "; auto: the decision and its median when decided (its leaders re-timed together, as "
                  "`flashkern table` shows it)", title_justify="left")
    table.add_column("shape", no_wrap=True, min_width=max(len(row.shape) for row in shape_rows))  # copyable keys
    table.add_column("moves", justify="right")
    for backend in op.backends:
        table.add_column(backend, justify="right")
    table.add_column("speedup", justify="right")
    table.add_column("auto")
    table.add_column("H200 model µs (roofline)", justify="right")
    for row in shape_rows:
        cells = []
        for backend in op.backends:
            r = row.best.get(backend)
            roof = f" ({row.bytes / r.median / bandwidth:.0%})" if r and bandwidth else ""
            spread = f" ±{r.iqr / r.median:.0%}" if r and r.iqr is not None else ""
            cells.append(f"{_us(r.median)}{spread}{roof}" if r else "—")
        ref, kernels = row.best.get("reference"), [r for b, r in row.best.items() if b != "reference"]
        best = min(kernels, key=lambda r: r.median) if kernels else None
        speedup = f"{best.key.impl} {ref.median / best.median:.2f}x" if best and ref else "—"
        auto = _decided(row.decision, row.best) if row.decision else "—"
        table.add_row(row.shape, _size(row.bytes), *cells, speedup, auto, _modelled(records, op, row.shape))
    console.print(table)
    failed = [r for row in shape_rows for r in row.failed]
    for r in failed[:20]:
        console.print(f"  [yellow]{r.status}[/yellow] {r.key.impl} {r.key.config} at {r.key.shape}: {r.reason}")
    if len(failed) > 20:
        console.print(f"  ... and {len(failed) - 20} more failed candidates")
    path = args.plot or f"{op.name}-{info.kind}.png"
    modelled = {impl.name: {shape: r["model_seconds"] for (name, backend, shape), r in records.items()
                            if name == op.name and backend == impl.name} for impl in op.implementations}
    report.plot(shape_rows, op.backends, f"{op.name} on {info.describe()}", path, modelled)
    console.print(f"plot: {path}")
    return 0


def cmd_store(args) -> int:
    from flashkern.autotune import store as stores

    path = stores.Path(args.db) if args.db else stores.default_path()
    if args.action == "quarantine":
        if not path.exists():
            console.print(f"no store at {path}")
            return 1
        if not args.force:
            try:
                with stores.Store(path) as store:
                    held = len(store.results())
            except StoreError:
                pass  # unreadable: what quarantine is for
            else:
                console.print(f"{path} is a readable store ({held} results): quarantine moves aside only a store that "
                              "cannot be read; pass --force to move this one anyway")
                return 1
        console.print(f"moved {path} aside to {stores.quarantine(path)}; the next tune starts a new store")
        return 0
    if not path.exists():
        console.print(f"no store at {path} (nothing created; `flashkern tune` makes one)")
        return 1
    with stores.Store(path) as store:
        results, decisions = store.results(), store.decisions()
    devices_seen = sorted({r.key.device for r in results})
    console.print(f"store: {path}\n{len(results)} results, {len(decisions)} decisions, devices: {devices_seen}")
    return 0


def run(args) -> int:
    """Run the verb flashkern_cli parsed (`args.command`)."""
    with warnings.catch_warnings():  # library warnings (an unreadable store, say) as one line each, no source line
        warnings.showwarning = lambda message, category, *_, **__: console.print(
            f"[yellow]{category.__name__}[/yellow]: {escape(str(message))}")
        try:
            return VERBS[args.command](args)
        except StoreError as exc:
            console.print(f"[red]{exc}[/red]")
            return 2


VERBS = {"list": cmd_list, "bench": cmd_bench, "compile-check": cmd_compile_check, "check": cmd_check,
         "model": cmd_model, "tune": cmd_tune, "table": cmd_table, "explain": cmd_explain, "report": cmd_report,
         "store": cmd_store}
