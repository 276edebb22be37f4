"""The autotuner, the result store and per-shape dispatch.

Tuning runs here on the CPU (TileLang's C target and the reference are timed; interpreted
Triton is only checked). Store robustness is tested with real processes: SIGKILL in the
middle of a sweep, two tuners on one store, a corrupt file.
"""

import dataclasses
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import torch
from filelock import FileLock

import flashkern.ops
from flashkern import device as devices
from flashkern import dispatch, registry
from flashkern.autotune import identity
from flashkern.autotune import store as st
from flashkern.autotune import table as tables
from flashkern.autotune.tuner import Summary, Tuner
from flashkern.cli import _us
from flashkern.kernels.moe_route import V3, V41_FLASH, RouteProblem

OP = registry.get("moe_route")
CPU = devices.info("cpu")
SHAPES = [RouteProblem(tokens=t, routing=r) for r in (V41_FLASH, V3) for t in (1, 37)]


def tune(path, problems=SHAPES, **kw):
    """Tune moe_route into the store at `path`, building in this process (the CLI tests spawn build workers), three
    configs per implementation unless asked (each TileLang config is a C compile, each Triton one an interpreted
    check)."""
    with st.Store(path) as store:
        return Tuner(store, "cpu", budget=kw.pop("budget", 0.02), workers=kw.pop("workers", 1),
                     max_configs=kw.pop("max_configs", 3), **kw).tune("moe_route", problems)


@pytest.fixture(scope="session")
def tuned(tmp_path_factory):
    """A store tuned once for SHAPES, and the summary of that sweep: once per test session, shared by the xdist
    workers (the first to take the lock tunes; the others read its summary), as the tests only read the store."""
    shared = tmp_path_factory.getbasetemp()  # under xdist each worker's own folder, in the session's:
    shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared
    path, saved = shared / "tuned.sqlite3", shared / "tuned-summary.json"
    with FileLock(str(shared / "tuned.lock")):
        if not saved.exists():
            saved.write_text(json.dumps(dataclasses.asdict(tune(path))))
        return path, Summary(**json.loads(saved.read_text()))


def test_a_sweep_stores_every_candidate_and_decides_every_shape(tuned):
    path, summary = tuned
    assert summary.decided == len(SHAPES) and summary.built > 0
    with st.Store(path) as store:
        results = store.results("moe_route", CPU.key)
        decisions = store.decisions("moe_route", CPU.key)
    assert {d.shape for d in decisions} == {p.key for p in SHAPES}
    for problem in SHAPES:
        mine = [r for r in results if r.key.shape == problem.key]
        assert {r.key.impl for r in mine} == {"reference", "triton", "tilelang"}
        assert all(r.status in (st.OK, st.CHECKED) for r in mine), [(r.key.impl, r.reason) for r in mine]
        assert len([r for r in mine if r.key.impl == "tilelang"]) > 1  # more than the default config
    # the interpreter is checked, never timed, never chosen
    assert all(r.status == st.CHECKED and r.median is None for r in results if r.key.impl == "triton")
    assert all(d.impl in ("reference", "tilelang") for d in decisions)
    # every timing has its spread and thread count (1 on CPU); every decision says how it was taken
    assert all(r.threads == 1 and r.iqr is not None and r.low <= r.median <= r.high
               for r in results if r.status == st.OK)
    assert all(d.threads == 1 and d.iqr is not None and d.reason.startswith(("fastest:", "within noise"))
               for d in decisions), [d.reason for d in decisions]
    # keys hold device identity and versions, including the kernel source hash
    row = results[0]
    versions = json.loads(row.key.versions)
    assert row.key.device == CPU.key and {"torch", "triton", "tilelang", "flashkern", "source"} <= set(versions)
    assert row.key.dtypes == "logits=float32,bias=float32"


def test_a_second_sweep_builds_and_times_nothing_new(tuned):
    path, first = tuned
    again = tune(path)
    assert (again.measured, again.built, again.decided) == (0, 0, 0)
    assert again.reused == first.measured + first.reused


def test_correctness_gate_stores_failures_that_never_win(tmp_path, monkeypatch):
    """A kernel config that computes wrong ids is rejected with its reason and cannot win."""
    from flashkern.kernels._tilelang import TileLangKernel

    real_run = TileLangKernel.run

    def wrong_for_block_t_2(self, problem, inputs, config, out):
        weights, ids = real_run(self, problem, inputs, config, out)
        if config["block_t"] == 2:
            ids.copy_(ids.flip(1).roll(1, dims=0) if ids.shape[0] > 1 else (ids + 1) % problem.routing.experts)
        return weights, ids

    monkeypatch.setattr(TileLangKernel, "run", wrong_for_block_t_2)
    path = tmp_path / "t.sqlite3"
    tune(path, problems=SHAPES[:2], max_configs=24)  # every config: block_t 2 among them
    with st.Store(path) as store:
        bad = [r for r in store.results() if r.key.impl == "tilelang" and json.loads(r.key.config)["block_t"] == 2]
        decisions = store.decisions()
    assert bad and all(r.status == st.INCORRECT and r.reason for r in bad)
    assert not any(d.impl == "tilelang" and json.loads(d.config)["block_t"] == 2 for d in decisions)


def test_rows_of_other_versions_or_devices_are_kept_but_never_used(tuned, tmp_path):
    path, _ = tuned
    copy = tmp_path / "copy.sqlite3"
    with st.Store(path) as src, st.Store(copy) as dst:
        for d in src.decisions():
            dst.decide(st.Decision(**{**d.__dict__, "versions": d.versions.replace('"torch"', '"torch-old"')}))
            dst.decide(st.Decision(**{**d.__dict__, "device": "cuda:Other GPU:sm90:132sm"}))
        assert len(dst.decisions()) == 2 * len(SHAPES)  # nothing dropped
        assert tables.current_decisions(dst, CPU.key) == []  # nothing used
        for r in src.results():
            dst.put(st.Result(**{**r.__dict__, "key": st.Key(**{**r.key.__dict__, "versions": "{}"})}))
    # a tuner treats those results as absent and measures anew
    summary = tune(copy, problems=SHAPES[:1])
    assert summary.measured > 0 and summary.reused == 0


def test_table_lookup_exact_then_nearest_bucket_then_nothing(tuned):
    path, _ = tuned
    with st.Store(path) as store:
        table = tables.from_store(store, CPU.key)
        decided = {d.shape: d for d in store.decisions()}
    assert len(table) == len(SHAPES)
    exact = table.lookup("moe_route", RouteProblem(tokens=33, routing=V3))  # 33 -> bucket 64, like 37
    assert exact.decision.shape == decided[RouteProblem(tokens=37, routing=V3).key].shape
    nearest = table.lookup("moe_route", RouteProblem(tokens=3000, routing=V3))  # bucket 4096: nearest is 64
    assert nearest.decision.sizes == (37,)
    nearest_small = table.lookup("moe_route", RouteProblem(tokens=2, routing=V3))  # bucket 2: nearest is 1
    assert nearest_small.decision.sizes == (1,)
    other_rule = RouteProblem(tokens=37, routing=V3, has_valid=True)  # another specialization
    assert table.lookup("moe_route", other_rule) is None


def test_auto_dispatch_follows_the_table(tmp_path, monkeypatch):
    """backend='auto' runs the tuned backend and config; untuned specializations use the default rule."""
    from flashkern.kernels._tilelang import TileLangKernel

    path = tmp_path / "t.sqlite3"
    problem = RouteProblem(tokens=37, routing=V41_FLASH)
    inputs = OP.make_inputs(problem, "cpu")
    with st.Store(path) as store:
        store.decide(st.Decision("moe_route", problem.key, identity.dtypes(inputs), CPU.key,
                                 identity.op_versions(OP), repr(problem.specialization()), problem.sizes,
                                 "tilelang", st.canonical({"block_t": 2, "threads": 128}), 1e-3, "test"))
    monkeypatch.setenv(st.ENV_VAR, str(path))
    dispatch.reload_tables()
    seen = []
    real_run = TileLangKernel.run
    monkeypatch.setattr(TileLangKernel, "run", lambda self, p, i, c, o: seen.append(c) or real_run(self, p, i, c, o))
    try:
        out = flashkern.ops.moe_route(**inputs)  # T=37 -> bucket 64: exact
        OP.compare(inputs, None, out)
        flashkern.ops.moe_route(**OP.make_inputs(problem.with_sizes((900,)), "cpu"))  # nearest bucket
        assert seen == [{"block_t": 2, "threads": 128}] * 2
        flashkern.ops.moe_route(**OP.make_inputs(RouteProblem(tokens=5, routing=V3), "cpu"))  # untuned: the rule
        assert len(seen) == 2  # the CPU rule runs the reference
        with pytest.raises(ValueError, match="config needs an explicit backend"):
            flashkern.ops.moe_route(**inputs, config={"block_t": 2, "threads": 128})
    finally:
        dispatch.reload_tables()


def test_export_and_import_json_tables(tuned, tmp_path):
    path, _ = tuned
    with st.Store(path) as store:
        text = tables.export_json(tables.current_decisions(store, CPU.key), CPU.key)
    fresh = tmp_path / "fresh.sqlite3"
    with st.Store(fresh) as store:
        assert tables.import_json(store, text) == len(SHAPES)
        assert len(tables.from_store(store, CPU.key)) == len(SHAPES)
    with pytest.raises(ValueError, match="not a flashkern table"):
        with st.Store(fresh) as store:
            tables.import_json(store, json.dumps({"format": "other"}))


# The tables of a schema-1 store (flashkern before spreads and thread counts were stored), verbatim.
SCHEMA_1 = """
CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE results (
    op TEXT NOT NULL, impl TEXT NOT NULL, config TEXT NOT NULL, shape TEXT NOT NULL, dtypes TEXT NOT NULL,
    device TEXT NOT NULL, versions TEXT NOT NULL,
    spec TEXT NOT NULL, sizes TEXT NOT NULL, is_default INTEGER NOT NULL,
    status TEXT NOT NULL, reason TEXT NOT NULL,
    median REAL, low REAL, high REAL, reps INTEGER,
    registers INTEGER, spills INTEGER, smem INTEGER,
    bytes REAL NOT NULL, flops REAL NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (op, impl, config, shape, dtypes, device, versions)
);
CREATE TABLE decisions (
    op TEXT NOT NULL, shape TEXT NOT NULL, dtypes TEXT NOT NULL, device TEXT NOT NULL, versions TEXT NOT NULL,
    spec TEXT NOT NULL, sizes TEXT NOT NULL,
    impl TEXT NOT NULL, config TEXT NOT NULL, median REAL NOT NULL, reason TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (op, shape, dtypes, device, versions)
);
INSERT INTO meta VALUES ('schema', '1');
"""


def test_a_schema_1_store_is_upgraded_in_place_and_its_timings_are_not_reused(tmp_path):
    """Old rows keep every value, with NULL spread and thread count; a tuner times such rows again (their
    thread count is unknown) and decides their shapes again, and keeps the untimed ones."""
    db = tmp_path / "old.sqlite3"
    problem = SHAPES[0]
    dtypes = identity.dtypes(OP.make_inputs(problem, "cpu"))
    triton = OP.implementation("triton").default_config(problem)
    common = (problem.key, dtypes, CPU.key)
    rows = [("reference", "{}", *common, identity.versions(OP, "reference"), repr(problem.specialization()), "[1]", 1,
             st.OK, "", 47e-3, 5e-4, 0.1, 7, None, None, None, 1e3, 1e3, 1.0),
            ("triton", st.canonical(triton), *common, identity.versions(OP, "triton"), repr(problem.specialization()),
             "[1]", 1, st.CHECKED, "correct; the interpreter is not timed", None, None, None, None, None, None, None,
             1e3, 1e3, 2.0)]
    with sqlite3.connect(db) as conn:
        conn.executescript(SCHEMA_1)
        conn.executemany(f"INSERT INTO results VALUES ({', '.join('?' * 22)})", [("moe_route", *r) for r in rows])
        conn.execute("INSERT INTO decisions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     ("moe_route", *common, identity.op_versions(OP), repr(problem.specialization()), "[1]",
                      "tilelang", '{"block_t":1,"threads":128}', 4.5e-3, "fastest", 3.0))
    conn.close()
    with st.Store(db) as store:
        old = {r.key.impl: r for r in store.results()}
        [decision] = store.decisions()
    assert (old["reference"].median, old["reference"].low, old["reference"].high, old["reference"].reps) == \
        (47e-3, 5e-4, 0.1, 7)
    assert all(r.iqr is None and r.threads is None for r in old.values()) and old["triton"].status == st.CHECKED
    assert (decision.impl, decision.median, decision.iqr, decision.threads) == ("tilelang", 4.5e-3, None, None)
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT value FROM meta").fetchall() == [(str(st.SCHEMA),)]
        assert {"iqr", "threads"} <= {c[1] for c in conn.execute("PRAGMA table_info(decisions)")}
    st.Store(db).close()  # opening an upgraded store changes nothing

    summary = tune(db, problems=[problem], backends=("triton",))  # the reference and checked Triton: no builds
    assert (summary.measured, summary.reused, summary.decided) == (1, 1, 1)
    with st.Store(db) as store:
        new = {r.key.impl: r for r in store.results()}
        [decision] = store.decisions()
    assert new["reference"].threads == 1 and new["reference"].iqr is not None and new["reference"].median < 47e-3
    assert new["triton"] == old["triton"]
    assert (decision.impl, decision.threads) == ("reference", 1) and decision.iqr is not None

    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE meta SET value = ? WHERE name = 'schema'", (str(st.SCHEMA + 1),))
    conn.close()
    with pytest.raises(st.StoreError, match="newer than this flashkern reads"):
        st.Store(db)


# ---------------------------------------------------------------- robustness, with real processes


def _cli(*args, db, **kw):
    env = {**os.environ, st.ENV_VAR: str(db)}
    return subprocess.Popen([sys.executable, "-m", "flashkern", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def _rows(db) -> list[tuple]:
    """The stored results; none while the tuner has created the file but not yet its schema."""
    with sqlite3.connect(db) as conn:
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'results'").fetchone():
            return []
        return conn.execute("SELECT op, impl, config, shape, status, median FROM results").fetchall()


def test_sweep_killed_with_sigkill_resumes_and_loses_nothing(tmp_path):
    db = tmp_path / "t.sqlite3"
    args = ("tune", "moe_route", "--shapes", "1,37", "--budget", "0.05", "--max-configs", "2", "--jobs", "1")  # what
    # resumes, not how many configs: each TileLang config is a C compile
    proc = _cli(*args, db=db)
    deadline = time.time() + 300
    while time.time() < deadline and (not db.exists() or len(_rows(db)) < 4):
        time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = set(_rows(db))
    assert len(before) >= 4, "the sweep stored nothing before it was killed"
    resumed = _cli(*args, db=db)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    after = set(_rows(db))
    assert before <= after  # every finished result survived, unchanged
    assert len(before) < len(after), "the kill came after the sweep had finished"
    reused = int(re.search(r"(\d+) reused", out).group(1))
    assert reused == len(before)  # the resumed sweep measured none of them again
    with st.Store(db) as store:
        assert {d.shape for d in store.decisions()} == {p.with_sizes((t,)).key for p in OP.presets["smoke"]
                                                        for t in (1, 37)}


def test_two_tuners_on_one_store_both_keep_every_result(tmp_path):
    db = tmp_path / "t.sqlite3"
    first = _cli("tune", "moe_route", "--shapes", "1", "--budget", "0.02", "--max-configs", "1", "--jobs", "1", db=db)
    second = _cli("tune", "moe_route", "--shapes", "99", "--budget", "0.02", "--max-configs", "1", "--jobs", "1", db=db)
    outs = [p.communicate(timeout=600)[0] for p in (first, second)]
    assert first.returncode == 0 and second.returncode == 0, outs
    with st.Store(db) as store:
        shapes = {r.key.shape for r in store.results()}
        decided = {d.shape for d in store.decisions()}
    wanted = {p.with_sizes((t,)).key for p in OP.presets["smoke"] for t in (1, 99)}
    assert shapes == wanted and decided == wanted


def test_concurrent_writers_lose_no_rows(tmp_path):
    """Two processes released at the same moment write 2000 rows each into one store: all 4000 are kept."""
    db = tmp_path / "t.sqlite3"
    st.Store(db).close()
    script = (
        "import os, sys, time; from flashkern.autotune import store as st\n"
        "s = st.Store(sys.argv[1]); open(sys.argv[3] + '.ready', 'w').close()\n"
        "while not os.path.exists(sys.argv[3] + '.go'): time.sleep(0.001)\n"
        "for i in range(2000):\n"
        "    s.put(st.Result(st.Key('op', sys.argv[2], str(i), 'shape', 'dt', 'dev', 'v'), 'spec', (i,), False,"
        " 1.0, 1.0, st.OK, median=1e-6))\n"
    )
    barrier = str(tmp_path / "barrier")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(db), name, f"{barrier}-{name}"]) for name in "ab"]
    deadline = time.time() + 120
    while not all(os.path.exists(f"{barrier}-{n}.ready") for n in "ab") and time.time() < deadline:
        time.sleep(0.01)
    for name in "ab":
        open(f"{barrier}-{name}.go", "w").close()
    assert all(p.wait(timeout=300) == 0 for p in procs)
    assert len(_rows(db)) == 4000


def test_corrupt_store_gives_a_clear_error_and_a_way_out(tmp_path):
    db = tmp_path / "t.sqlite3"
    garbage = b"this is not a database" * 100
    db.write_bytes(garbage)
    with pytest.raises(st.StoreError, match="cannot be read") as info:
        st.Store(db)
    assert str(db) in str(info.value) and "flashkern store quarantine" in str(info.value)
    proc = _cli("store", "info", "--db", str(db), db=db)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "cannot be read" in out
    proc = _cli("store", "quarantine", "--db", str(db), db=db)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("t.sqlite3.unreadable-")]
    assert len(kept) == 1 and kept[0].read_bytes() == garbage  # moved aside, not lost
    st.Store(db).close()  # a new store starts cleanly
    with pytest.warns(RuntimeWarning, match="cannot be read"):  # serving code warns and keeps running
        db.write_bytes(garbage)
        os.environ[st.ENV_VAR] = str(db)
        try:
            dispatch.reload_tables()
            flashkern.ops.moe_route(torch.randn(3, 16), top_k=2)
        finally:
            del os.environ[st.ENV_VAR]
            dispatch.reload_tables()


def test_report_compares_backends_and_writes_a_plot(tuned, tmp_path):
    path, _ = tuned
    png = tmp_path / "report.png"
    proc = _cli("report", "moe_route", "--db", str(path), "--plot", str(png), db=path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for problem in SHAPES:
        assert problem.key in out
    assert "speedup" in out
    table = _cli("table", "moe_route", "--db", str(path), db=path)
    table_out, _ = table.communicate(timeout=300)
    assert table.returncode == 0, table_out
    with st.Store(path) as store:  # both show each decision's own (re-timed) median, and say which measurement
        decided = store.decisions("moe_route", devices.info("cpu").key)
    assert decided
    for decision in decided:
        shown = f"{decision.impl} {_us(decision.median)}"
        assert shown in out, (shown, out)
        assert re.search(rf"{decision.impl}\s.*{re.escape(_us(decision.median))}", table_out), (shown, table_out)
    assert "re-timed" in out and "re-timed" in table_out


def test_tune_command_prints_the_table_and_resumes(tmp_path):
    db = tmp_path / "t.sqlite3"
    args = ("tune", "moe_route", "--shapes", "3", "--budget", "0.02", "--max-configs", "1", "--jobs", "1")
    first = _cli(*args, db=db)
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 0 and "backend='auto'" in out, out
    second = _cli(*args, db=db)
    out, _ = second.communicate(timeout=600)
    assert second.returncode == 0 and "0 new results" in out and "0 builds" in out and "0 new decisions" in out, out


def test_library_versions_read_without_importing_are_the_libraries_own():
    """Results are keyed on Triton's and TileLang's versions, read from their metadata (reading a store imports
    neither): the strings their modules report, so results stored before this stay current."""
    import tilelang
    import triton

    versions = identity.library_versions()
    assert (versions["triton"], versions["tilelang"]) == (triton.__version__, tilelang.__version__)
