"""The flashkern command line's front door: arguments parsed and checked before anything heavy is imported.

`flashkern --help` and a usage error take a fraction of a second: torch, Triton and TileLang (a second or two
to import) load only once a verb runs (flashkern.cli; importing flashkern registers every operator).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

VERBS = """verbs:
  flashkern list                         operators, and which implementations run here (and why not)
  flashkern bench [OP ...] [--preset P]  time every backend at a preset's shapes (default: smoke)
  flashkern compile-check [OP ...]       build every implementation for sm_90a (default + sampled configs), lint the build
  flashkern check OP [--backend B]       property-based equivalence of one kernel (and --config) with the
                                         reference; a failure shrunk to a runnable snippet
  flashkern model [OP ...] [--preset P]  predicted H200 time and roofline fraction per kernel (a model; bench
                                         and report show the saved one, docs/model-h200.json)
  flashkern tune OP... [--preset P]      measure every implementation and config per shape into the store
                                         (--ray local:N | auto | ADDRESS: over a Ray cluster)
  flashkern table OP                     what backend="auto" runs per shape here; --export / --import JSON
  flashkern explain OP [--shapes 1,37]   what backend="auto" runs per shape here, and why
  flashkern report OP                    per-shape comparison of the stored results, and a PNG plot
  flashkern store info|quarantine        where the tuning store is and what it holds; move a broken one aside
"""

KERNEL_BACKENDS = ("triton", "tilelang")  # every operator's implementations (tests/test_registry.py holds them to it)


def device_name(text: str) -> str:
    """--device: cpu, or cuda (with an index) where this torch has CUDA."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: expected cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: flashkern runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: this torch has no usable CUDA device (torch {torch.__version__})")
    return text


def _number(kind, low: float, strict: bool, what: str):
    """An argparse type: a `kind` (int or float) above `low` (strictly when `strict`), else a one-line usage error."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not low <= value < float("inf") or (strict and value == low):  # NaN fails the first test too
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


positive_int = _number(int, 0, True, "a positive integer")
count = _number(int, 0, False, "a count (an integer >= 0)")
seconds = _number(float, 0.0, True, "a positive number of seconds")


def backend_list(text: str) -> list[str]:
    """--backends: kernel names, comma-separated."""
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in KERNEL_BACKENDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown backend {unknown[0]!r}: expected "
                                         f"{' or '.join(KERNEL_BACKENDS)}, comma-separated")
    return names


def ray_address(text: str) -> str:
    """--ray: local:N (N >= 1), auto, or a cluster address."""
    if text.startswith("local:"):
        positive_int(text.split(":", 1)[1])
    elif not text:
        raise argparse.ArgumentTypeError("expected local:N, auto or a cluster address (host:port)")
    return text


def config_json(text: str) -> dict:
    """--config: a JSON object of tuning parameters."""
    try:
        config = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON (e.g. '{{\"block_t\": 4}}')") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object of tuning parameters")
    return config


def output_file(text: str) -> str:
    """A file the verb writes: its folder must exist and be writable (checked before any work is done)."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: no folder {folder}")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {folder} is not writable")
    return text


def writable_folder(text: str) -> str:
    """A folder the verb writes into: it must exist and be writable."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder")
    if not os.access(text, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    return text


def shape_list(text: str) -> list[tuple[int, ...]]:
    """--shapes: comma-separated shapes, each a positive size or several joined by 'x' (64x128)."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if not all(part.isdigit() and int(part) > 0 for part in parts):
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not a shape: expected positive integers, "
                                             "comma-separated (1,7,300), several per shape joined by x (64x128)")
        shapes.append(tuple(int(part) for part in parts))
    return shapes


def parser() -> argparse.ArgumentParser:
    """Every verb's arguments, checked as parsed (one-line usage errors)."""
    found = argparse.ArgumentParser(
        prog="flashkern", description="Triton and TileLang kernels for DeepSeek-V4.1-Flash-class inference",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=VERBS)
    sub = found.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="operators and where their implementations run")

    p = sub.add_parser("bench", help="time every backend at a preset's shapes")
    p.add_argument("ops", nargs="*", help="operators (default: all)")
    p.add_argument("--preset", default="smoke", help="shape preset (default: smoke)")
    p.add_argument("--device", type=device_name, default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--shapes", type=shape_list, default=None,
                   help="explicit sizes for each specialization of the preset, comma-separated (e.g. 1,7,300; "
                   "multi-dimensional as 64x128)")
    p.add_argument("--backends", type=backend_list, default=None,
                   help="kernels to time besides the reference, comma-separated")
    p.add_argument("--budget", type=seconds, default=0.3, help="seconds of timing per cell (default: 0.3)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads while timing (default: 1 on CPU, torch's on CUDA)")
    p.add_argument("--time-interpreted", action="store_true",
                   help="time interpreted Triton too (a correctness path on CPU, checked but not timed by default)")
    p.add_argument("--json", type=output_file, help="also write the rows to this JSON file")

    p = sub.add_parser("compile-check", help="build every implementation for sm_90a, report resources, lint what was built")
    p.add_argument("ops", nargs="*", help="operators (default: all)")
    p.add_argument("--preset", default="smoke", help="preset whose kernel specializations are built")
    p.add_argument("--sample", type=count, default=2, help="sampled configs per implementation besides the default")
    p.add_argument("--seed", type=count, default=0, help="seed of the config sample")
    p.add_argument("--jobs", type=positive_int, default=None, help="parallel build processes (default: CPU count)")
    p.add_argument("--impl", choices=("triton", "tilelang"), default=None, help="build one DSL's kernels only")
    p.add_argument("--json", type=output_file, help="also write the results to this JSON file")

    p = sub.add_parser("check", help="property-based equivalence of one kernel with the reference")
    p.add_argument("op", help="operator")
    p.add_argument("--backend", choices=("reference", "triton", "tilelang"), default=None,
                   help="implementation to check (default: each)")
    p.add_argument("--config", type=config_json, default=None, help='a config of its tuning space, as JSON '
                   '(e.g. \'{"block_t": 4, "num_warps": 4}\'); cases it does not apply to are skipped')
    p.add_argument("--examples", type=positive_int, default=50, help="cases to draw (default: 50)")
    p.add_argument("--seed", type=count, default=0, help="hypothesis seed (default: 0)")
    p.add_argument("--device", type=device_name, default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--save-dir", type=writable_folder, default=".",
                   help="where a failing case too large to inline is saved (default: .)")

    p = sub.add_parser("model", help="predicted time and roofline fraction per kernel on a GPU (a model)")
    p.add_argument("ops", nargs="*", help="operators (default: all that have the preset)")
    p.add_argument("--preset", default="v41-flash", help="shape preset (default: v41-flash)")
    p.add_argument("--device", default="h200", choices=("h200", "gh200", "h100", "b200"),
                   help="GPU modelled (default: h200)")
    p.add_argument("--sample", type=count, default=0, help="sampled configs per implementation besides the default")
    p.add_argument("--seed", type=count, default=0, help="seed of the config sample")
    p.add_argument("--jobs", type=positive_int, default=None, help="parallel build processes (default: CPU count)")
    p.add_argument("--json", type=output_file, help="also write the rows (with every stage) to this JSON file")
    p.add_argument("--markdown", type=output_file,
                   help="also write the default configs' rows as a Markdown table to this file")

    def store_options(p):
        p.add_argument("--db", default=None, help="tuning store (default: $FLASHKERN_TUNE_DB or the user cache dir)")
        p.add_argument("--device", type=device_name, default=None, help="cpu or cuda (default: cuda if present)")

    p = sub.add_parser("tune", help="measure every implementation and config per shape into the store")
    p.add_argument("ops", nargs="+", metavar="OP", help="operators")
    p.add_argument("--preset", default="smoke", help="shape preset (default: smoke)")
    p.add_argument("--shapes", type=shape_list, default=None,
                   help="explicit sizes for each specialization of the preset, comma-separated (e.g. 1,7,300; "
                   "multi-dimensional as 64x128)")
    p.add_argument("--budget", type=seconds, default=0.2,
                   help="seconds of timing per candidate per pass of rounds (default: 0.2)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads while timing, stored with each result (default: 1 on CPU, torch's on CUDA)")
    p.add_argument("--max-configs", type=count, default=24, help="configs per implementation and shape (0: all)")
    p.add_argument("--jobs", type=positive_int, default=None, help="parallel build processes (default: CPU count)")
    p.add_argument("--seed", type=count, default=0, help="seed of the inputs and the config sample")
    p.add_argument("--ray", type=ray_address, default=None, metavar="ADDRESS",
                   help="run the sweep on a Ray cluster: local:N (N worker CPUs on this machine), auto (the cluster "
                   "this machine belongs to) or host:port; --device defaults to the cluster's GPUs if it has any")
    store_options(p)

    p = sub.add_parser("table", help="what backend='auto' runs per shape on this device")
    p.add_argument("op")
    p.add_argument("--export", type=output_file, help="write this device's current decisions to a JSON file")
    p.add_argument("--import", dest="import_file", help="store the decisions of an exported JSON table")
    store_options(p)

    p = sub.add_parser("explain", help="what backend='auto' runs per shape here, and why")
    p.add_argument("op")
    p.add_argument("--preset", default="smoke", help="shape preset (default: smoke)")
    p.add_argument("--shapes", type=shape_list, default=None,
                   help="explicit sizes for each specialization of the preset, comma-separated (e.g. 1,7,300)")
    store_options(p)

    p = sub.add_parser("report", help="per-shape comparison of the stored results, and a PNG plot")
    p.add_argument("op")
    p.add_argument("--plot", type=output_file, default=None, help="PNG path (default: OP-DEVICE.png)")
    store_options(p)

    p = sub.add_parser("store", help="the tuning store: info, or quarantine an unreadable one")
    p.add_argument("action", choices=("info", "quarantine"))
    p.add_argument("--force", action="store_true", help="quarantine: move the store aside even if it is readable")
    p.add_argument("--db", default=None, help="tuning store (default: $FLASHKERN_TUNE_DB or the user cache dir)")

    return found


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from flashkern import cli

    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
