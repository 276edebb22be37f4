"""Predicted vs measured, per kernel and shape: calibrates the performance model (flashkern.model) on a GPU.

Joins a saved model (`flashkern model --json MODEL`, made on any machine: it needs Triton's interpreter and
TileLang, which a GPU image may lack; records of changed kernel sources are dropped) with measured times
(`flashkern bench --json BENCH` on the GPU) by (operator, backend, shape), default configs.
Run: python benchmarks/model_vs_measured.py MODEL BENCH... [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics

from flashkern import model


def joined(model_path: str, bench_paths: list[str]) -> list[dict]:
    predicted = model.current_records(model_path)
    measured = []
    for path in bench_paths:
        with open(path) as f:
            measured += json.load(f)
    rows = []
    for m in measured:
        record = predicted.get((m["op"], m["backend"], m["shape"]))
        if record is None or m.get("median_s") is None:
            continue
        rows.append(dict(op=m["op"], backend=m["backend"], shape=m["shape"], model_s=record["model_seconds"],
                         measured_s=m["median_s"], measured_over_model=m["median_s"] / record["model_seconds"],
                         roofline_fraction_model=record["roofline_fraction"],
                         roofline_fraction_measured=record["roof_seconds"] / m["median_s"]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="JSON from flashkern model --json")
    parser.add_argument("bench", nargs="+", help="JSON from flashkern bench --json (one or more)")
    parser.add_argument("--json", help="also write the joined rows here")
    args = parser.parse_args()
    rows = joined(args.model, args.bench)
    print(f"{'operator':18} {'backend':9} {'shape':44} {'model us':>9} {'measured':>9} {'ratio':>6} {'roofline':>9}")
    for r in rows:
        print(f"{r['op']:18} {r['backend']:9} {r['shape'][:44]:44} {r['model_s'] * 1e6:9.1f} "
              f"{r['measured_s'] * 1e6:9.1f} {r['measured_over_model']:6.2f} {r['roofline_fraction_measured']:9.1%}")
    if rows:
        print(f"measured / model: median {statistics.median(r['measured_over_model'] for r in rows):.2f} over "
              f"{len(rows)} kernel-shapes")
    else:
        print("no (operator, backend, shape) in both files with a current model record")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
