"""The H200 model of a Triton implementation as another Triton builds it (a second environment), priced here.

`flashkern model` builds with the Triton it runs. The oldest Triton we support (3.6, the known H200 image's) builds
other code, and its interpreter cannot count every kernel's traffic (it fails on the attention's tuple
accumulators), so this builds each config under BUILDER (the python of that environment, whose flashkern is this
checkout installed editable, as scripts/triton36_check.sh makes it) and prices the builds with this process's
traffic count: the bytes and loop trips are the source's, whichever Triton runs it; registers, spills and SASS are
the builder's. Each --set overrides the default config (one row per shape and --set):

    python benchmarks/triton_versions.py sparse_decode_attention --builder .venv-triton36/bin/python \\
        --set block_h=64 --set block_h=16
"""

from __future__ import annotations

import argparse
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import flashkern
from flashkern import compile_check, model, registry


def jobs(op_name: str, preset: str, overrides: list[dict]) -> list[compile_check.BuildJob]:
    op = registry.get(op_name)
    impl = op.implementation("triton")
    found = []
    for problem in op.presets[preset]:
        with flashkern.planning_for_gpu():
            default = impl.default_config(problem)
        found += [compile_check.BuildJob(op.name, impl.name, problem, dict(default, **changes), issue=True)
                  for changes in overrides]
    return found


def build(op_name: str, preset: str, overrides: list[dict], out: Path) -> None:
    """In the builder: build every job and pickle (job, result) pairs to `out`."""
    planned = jobs(op_name, preset, overrides)
    out.write_bytes(pickle.dumps(list(zip(planned, compile_check.run(planned)))))


def price(op_name: str, built) -> list[str]:
    """Markdown rows: each build at its shape on the H200 model, with this process's traffic count."""
    import triton

    op = registry.get(op_name)
    impl = op.implementation("triton")
    rows = ["| shape | config | kernel µs | bound | registers | spills B |", "|---|---|---:|---|---:|---:|"]
    for job, result in built:
        if not result.ok:
            rows.append(f"| {job.problem.key} | {job.config} | build failed: {result.error[:80]} | | | |")
            continue
        traffic = model._traffic(op, impl, job.problem, job.config)
        p = model.predict(op.cost(job.problem), list(zip(result.stages, traffic, strict=True)), model.DEVICES["h200"])
        rows.append(f"| {job.problem.key} | {job.config} | {p.kernel_seconds * 1e6:.1f} | {p.bound} | "
                    f"{max(s.registers for s in result.stages)} | {max(s.spills for s in result.stages)} |")
    return [f"Built by the builder's Triton, traffic counted with Triton {triton.__version__} here:", "", *rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op")
    parser.add_argument("--builder", required=True, help="the python of the environment whose Triton builds")
    parser.add_argument("--preset", default="v41-flash")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                        help="a config override (ints); one row per shape and --set")
    parser.add_argument("--build-only", type=Path, help=argparse.SUPPRESS)  # the builder's side
    args = parser.parse_args()
    overrides = [{name: int(value) for name, value in (pair.split("=") for pair in spec.split(","))}
                 for spec in args.set] or [{}]
    if args.build_only:
        build(args.op, args.preset, overrides, args.build_only)
        return
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "built.pkl"
        subprocess.run([args.builder, __file__, *sys.argv[1:], "--build-only", str(out)], check=True)
        built = pickle.loads(out.read_bytes())
    print("\n".join(price(args.op, built)))


if __name__ == "__main__":
    main()
