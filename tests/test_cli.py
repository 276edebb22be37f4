"""The command line: list, bench and compile-check as a user runs them."""

import json
import os
import subprocess
import sys

import pytest

from flashkern import device as devices
from flashkern import dispatch, registry
from flashkern_cli import main


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashkern", *args], capture_output=True, text=True, timeout=900)


def test_list_shows_every_operator_and_where_it_runs():
    proc = run_cli("list")
    assert proc.returncode == 0, proc.stderr
    for name in registry.operators():
        assert name in proc.stdout
    assert "Triton interpreter" in proc.stdout and "TileLang C target" in proc.stdout
    assert proc.stdout.count("[auto]") == len(registry.operators()) + 1  # one default per operator, and the legend


def test_bench_prints_a_table_per_operator_and_checks_outputs(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "moe_route", "--budget", "0.01", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    problems = registry.get("moe_route").presets["smoke"]
    assert len(rows) == 3 * len(problems)  # reference, triton, tilelang per shape
    timed = [r for r in rows if r["backend"] != "triton"]
    assert all(r["status"] in ("ok", "reference") and r["median_s"] > 0 and r["iqr_s"] >= 0 and r["threads"] == 1
               for r in timed)
    assert all(r["status"] == "checked" and r["median_s"] is None for r in rows if r["backend"] == "triton")
    assert problems[0].key in proc.stdout


def test_the_fastest_column_may_name_the_reference():
    from flashkern.cli import _fastest

    assert _fastest({"reference": 1e-4, "tilelang": 4e-4}) == "reference"
    assert _fastest({"reference": 4e-4, "tilelang": 1e-4}) == "tilelang 4.00x ref"


def test_long_lines_are_not_wrapped_off_a_terminal():
    """A line meant to be copied (the bench header here) stays one line when stdout is a pipe."""
    proc = run_cli("bench", "sinkhorn", "--budget", "0.001", "--backends", "triton")
    header = next(line for line in proc.stdout.splitlines() if line.startswith("bench on"))
    assert header.endswith("where a call cannot be captured: marked eager)"), header


def test_bench_and_compile_check_refuse_unknown_names():
    with pytest.raises(SystemExit, match="unknown operator 'nope'"):
        main(["bench", "nope"])
    with pytest.raises(SystemExit, match="no operator here has preset 'huge'; presets: smoke, v3, v41-flash"):
        main(["compile-check", "moe_route", "--preset", "huge"])


def test_a_preset_runs_the_operators_that_have_it_and_names_the_others(capsys):
    from flashkern.cli import _with_preset

    assert _with_preset(["moe_route", "sinkhorn", "topk_indices"], "v3") == ["moe_route"]
    assert "no preset 'v3', skipped: sinkhorn, topk_indices" in capsys.readouterr().out


def test_compile_check_command_exits_zero_and_writes_json(tmp_path):
    out = tmp_path / "builds.json"
    proc = run_cli("compile-check", "sinkhorn", "--sample", "0", "--jobs", "1", "--json", str(out))  # the quickest builds
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert rows and all(r["ok"] or r["skipped"] for r in rows)
    assert "sm_90a build check" in proc.stdout


def test_ci_runs_the_readme_test_command():
    """The README's quick-start test line is exactly what CI runs."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    commands = [line for line in (root / "README.md").read_text().splitlines() if line.startswith("python3 -m venv")]
    assert len(commands) == 2 and "python -m pytest" in commands[1]
    assert commands[1] in (root / ".ci" / "run").read_text().splitlines()


@pytest.mark.parametrize("shapes, message", [("abc", "'abc' is not a shape"), ("1,2x", "'2x' is not a shape"),
                                             ("0", "'0' is not a shape: expected positive integers")])
def test_bad_shapes_are_argument_errors_naming_the_flag(capsys, shapes, message):
    for command in ("tune", "bench"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "moe_route", "--shapes", shapes])
        assert exit_info.value.code == 2
        assert "argument --shapes: " + message in capsys.readouterr().err


def test_shapes_with_the_wrong_number_of_sizes_are_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"^--shapes: moe_route takes 1 size\(s\) per shape, got 4x8$"):
        main(["tune", "moe_route", "--shapes", "4x8", "--db", str(tmp_path / "t.sqlite3")])
    assert not (tmp_path / "t.sqlite3").exists()


@pytest.mark.parametrize("argv, message", [
    (["check", "moe_route", "--examples", "-3"], "argument --examples: '-3' is not a positive integer"),
    (["check", "moe_route", "--seed", "x"], "argument --seed: 'x' is not a count (an integer >= 0)"),
    (["tune", "moe_route", "--max-configs", "-2"], "argument --max-configs: '-2' is not a count (an integer >= 0)"),
    (["tune", "moe_route", "--budget", "0"], "argument --budget: '0' is not a positive number of seconds"),
    (["bench", "moe_route", "--budget", "-1"], "argument --budget: '-1' is not a positive number of seconds"),
    (["bench", "moe_route", "--budget", "nan"], "argument --budget: 'nan' is not a positive number of seconds"),
    (["bench", "moe_route", "--budget", "inf"], "argument --budget: 'inf' is not a positive number of seconds"),
    (["bench", "moe_route", "--threads", "0"], "argument --threads: '0' is not a positive integer"),
    (["bench", "moe_route", "--backends", "cuda_magic"],
     "argument --backends: unknown backend 'cuda_magic': expected triton or tilelang, comma-separated"),
    (["compile-check", "moe_route", "--jobs", "0"], "argument --jobs: '0' is not a positive integer"),
    (["model", "--sample", "-1"], "argument --sample: '-1' is not a count (an integer >= 0)"),
    (["check", "moe_route", "--config", "{bad"], "argument --config: '{bad' is not JSON (e.g. '{\"block_t\": 4}')"),
    (["check", "moe_route", "--config", "[4]"], "argument --config: '[4]' is not a JSON object of tuning parameters"),
    (["check", "moe_route", "--save-dir", "/no/such/folder"], "argument --save-dir: '/no/such/folder' is not a folder"),
    (["bench", "moe_route", "--json", "/no/such/folder/rows.json"],
     "argument --json: cannot write '/no/such/folder/rows.json': no folder /no/such/folder"),
    (["model", "--markdown", "/"], "argument --markdown: '/' is a folder, not a file"),
    (["report", "moe_route", "--plot", "/no/such/folder/r.png"],
     "argument --plot: cannot write '/no/such/folder/r.png': no folder /no/such/folder"),
    (["table", "moe_route", "--export", "/no/such/folder/t.json"],
     "argument --export: cannot write '/no/such/folder/t.json': no folder /no/such/folder"),
])
def test_numbers_and_names_out_of_range_are_one_line_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].endswith(message) and "Traceback" not in err


def test_a_config_outside_the_space_is_a_usage_error_not_a_failure_to_shrink(tmp_path, capsys):
    assert main(["check", "moe_route", "--backend", "triton", "--config", '{"bogus": 1}', "--save-dir",
                 str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashkern check: error: --config: config: unknown keys ['bogus']") and not list(
        tmp_path.iterdir())


def test_bad_files_stores_and_devices_are_named_in_one_line(tmp_path, capsys):
    """--import of a missing file, of a non-JSON file, of another format, of entries without their fields; report,
    table and explain on a store path that does not exist (nothing created there); devices flashkern does not run
    on. Each a message naming it, no traceback."""
    db = str(tmp_path / "t.sqlite3")
    (tmp_path / "n.json").write_text("notjson")
    (tmp_path / "f.json").write_text('{"format": 1}')
    (tmp_path / "e.json").write_text('{"format": "flashkern-table-1", "entries": [{"op": "moe_route"}]}')
    cases = [
        (["table", "moe_route", "--import", str(tmp_path / "missing.json"), "--db", db],
         "--import: cannot read .*missing.json: No such file or directory"),
        (["table", "moe_route", "--import", str(tmp_path / "n.json"), "--db", db], r"n\.json: not JSON"),
        (["table", "moe_route", "--import", str(tmp_path / "f.json"), "--db", db], "not a flashkern table"),
        (["table", "moe_route", "--import", str(tmp_path / "e.json"), "--db", db],
         "entry 0 lacks shape, dtypes, .*; nothing imported"),
        (["report", "moe_route", "--db", str(tmp_path / "no" / "x.sqlite3")], "^no store at .*x.sqlite3"),
        (["table", "moe_route", "--db", str(tmp_path / "no" / "x.sqlite3")], "^no store at .*x.sqlite3"),
        (["explain", "moe_route", "--db", str(tmp_path / "no" / "x.sqlite3")], "^no store at .*x.sqlite3"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit, match=message):
            main(argv)
    assert not (tmp_path / "no").exists()
    for device, message in (("tpu", "'tpu' is not a device: expected cpu or cuda"),
                            ("meta", "'meta': flashkern runs on cpu or cuda")):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "moe_route", "--device", device])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_library_warning_is_one_line(tmp_path, capsys, monkeypatch):
    """explain on an unreadable store: the dispatcher's warning as one line, without Python's source line. (explain
    points the process's default store at --db: the environment and the dispatch tables are restored after.)"""
    from flashkern.autotune import store as stores

    bad = tmp_path / "bad.sqlite3"
    bad.write_bytes(b"not a database")
    monkeypatch.setenv(stores.ENV_VAR, str(bad))
    try:
        assert main(["explain", "moe_route", "--db", str(bad)]) == 0
    finally:
        monkeypatch.undo()
        dispatch.reload_tables()
    out = capsys.readouterr().out
    warning = [line for line in out.splitlines() if "RuntimeWarning" in line]
    assert len(warning) == 1 and "warnings.warn" not in out


def test_store_quarantine_refuses_a_readable_store_unless_forced(tmp_path, capsys):
    """A store `store info` can read is not moved aside (that would look like losing it) unless --force; an
    unreadable one is."""
    from flashkern.autotune import store as stores

    good = tmp_path / "good.sqlite3"
    with stores.Store(good):
        pass
    assert main(["store", "quarantine", "--db", str(good)]) == 1
    assert "is a readable store (0 results)" in capsys.readouterr().out and good.exists()
    assert main(["store", "quarantine", "--db", str(good), "--force"]) == 0
    assert not good.exists() and list(tmp_path.glob("good.sqlite3.unreadable-*"))
    bad = tmp_path / "bad.sqlite3"
    bad.write_bytes(b"not a database")
    assert main(["store", "quarantine", "--db", str(bad)]) == 0
    assert not bad.exists()


def test_store_info_on_a_missing_path_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "typo" / "store.sqlite3"
    assert main(["store", "info", "--db", str(missing)]) == 1
    assert "no store at" in capsys.readouterr().out
    assert not (tmp_path / "typo").exists()


def _decision(op, problem, impl: str, config: dict):
    from flashkern.autotune import identity
    from flashkern.autotune import store as stores

    return stores.Decision(op.name, problem.key, "", devices.info("cpu").key, identity.op_versions(op),
                           repr(problem.specialization()), problem.sizes, impl, stores.canonical(config), 1e-5, "test")


def test_explain_says_what_auto_runs_and_why(capsys):
    """The default rule untuned; a tuned size bucket, and the nearest one for another size, from the table."""
    from flashkern.autotune import table as tables
    from flashkern.kernels.moe_route import V41_FLASH, RouteProblem

    assert main(["explain", "moe_route", "--shapes", "1,37"]) == 0
    out = capsys.readouterr().out
    assert out.count("default rule on cpu: the reference beats the CPU kernel paths") == 4  # 2 shapes x 2 specs
    op = registry.get("moe_route")
    tuned = RouteProblem(16, V41_FLASH)
    config = op.implementation("tilelang").default_config(tuned)
    info = devices.info("cpu")
    dispatch._TABLES[info.key] = tables.Table([_decision(op, tuned, "tilelang", config)])
    try:
        assert dispatch.explain(op, tuned, info) == ("tilelang", config, "tuned: this size bucket")
        assert dispatch.explain(op, tuned.with_sizes((300,)), info)[2] == "tuned: nearest size bucket (tuned at (16,))"
        assert dispatch.auto_choice(op, tuned, info) == (op.implementation("tilelang"), config)
    finally:
        dispatch.reload_tables()


def test_dispatch_decisions_are_logged_once_per_problem():
    code = ("import flashkern.ops as ops, torch\n"
            "x = torch.randn(3, 64)\n"
            "for _ in range(3): ops.moe_route(x, top_k=2)\n"
            "ops.moe_route(x, top_k=2, backend='tilelang')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "FLASHKERN_LOG_DISPATCH": "1"})
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("flashkern: moe_route")]
    assert len(lines) == 1 and "reference" in lines[0] and "default rule on cpu" in lines[0], proc.stderr


FRONT_DOOR = """
import sys

import flashkern_cli

for argv in (["--help"], ["tune", "--help"], ["check", "moe_route", "--examples", "-3"], ["bench", "--budget", "nan"]):
    try:
        flashkern_cli.main(argv)
    except SystemExit as exc:
        assert exc.code in (0, 2), (argv, exc.code)
    else:
        raise AssertionError(f"{argv} ran a verb")
heavy = sorted(name for name in ("torch", "triton", "tilelang", "flashkern", "rich") if name in sys.modules)
assert not heavy, heavy
"""


def test_help_and_usage_errors_import_nothing_heavy():
    """`flashkern --help` and a usage error answer before torch, Triton, TileLang or flashkern itself is imported
    (a second or two on this machine; the front door alone takes a few hundredths)."""
    proc = subprocess.run([sys.executable, "-c", FRONT_DOOR], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "flashkern tune OP" in proc.stdout  # the verbs' list is in the help
