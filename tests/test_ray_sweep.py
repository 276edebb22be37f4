"""Sweeps on a Ray cluster (autotune/ray_sweep.py), with a local cluster of worker processes on this machine.

Ray comes with the test extra (`pip install -e ".[test]"`), so a missing Ray fails here rather than skipping.
"""

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import ray  # noqa: F401

from flashkern.autotune import ray_sweep

# default configs only (few C compiles), one shape per specialization
SWEEP = ("tune", "moe_route", "sinkhorn", "--shapes", "7", "--max-configs", "1", "--budget", "0.05")


def _tune(db, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flashkern", *SWEEP, "--db", str(db), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finished(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    return out


def _stored(db) -> tuple[set, set]:
    """(every result as what it measured and its status, every decided shape); timings aside."""
    with sqlite3.connect(db) as conn:
        results = set(conn.execute("SELECT op, impl, config, shape, dtypes, device, versions, threads, status "
                                   "FROM results").fetchall())
        decided = set(conn.execute("SELECT op, shape, dtypes, device, versions, threads FROM decisions").fetchall())
    return results, decided


def _measuring_workers() -> list[int]:
    """The Ray worker processes running a shape's task now (Ray names a busy worker's process after its task)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::_measure"):
                    found.append(int(pid))
        except OSError:  # gone meanwhile
            continue
    return found


def test_a_sweep_on_ray_survives_a_killed_worker_and_equals_one_process(tmp_path):
    """A smoke sweep of two operators over a local cluster of 3 workers, one of them killed (SIGKILL) while it
    measures a shape: the sweep completes, stores the same results and decisions as the sweep in one process
    (timings aside), and a rerun measures and builds nothing."""
    one, on_ray = tmp_path / "one.sqlite3", tmp_path / "ray.sqlite3"
    _finished(_tune(one, "--jobs", "1"))  # also fills TileLang's disk cache: the Ray builds are cache hits
    proc = _tune(on_ray, "--ray", "local:3")
    killed, deadline = None, time.time() + 300
    while killed is None and proc.poll() is None and time.time() < deadline:
        workers = _measuring_workers()
        if workers:
            os.kill(workers[0], signal.SIGKILL)
            killed = workers[0]
        time.sleep(0.02)
    _finished(proc)
    assert killed is not None, "no worker was seen measuring: nothing was killed"
    assert _stored(on_ray) == _stored(one)
    rerun = _finished(_tune(on_ray, "--ray", "local:2"))
    assert len(re.findall(r": \d+ new results, \d+ reused, 0 builds, 0 new decisions", rerun)) == 2, rerun
    assert re.findall(r": (\d+) new results", rerun) == ["0", "0"], rerun


def test_ray_missing_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(SystemExit, match=re.escape('pip install -e ".[ray]"')):
        ray_sweep.connect("local:1")


def test_ray_addresses_are_checked_as_parsed(capsys):
    from flashkern_cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["tune", "moe_route", "--ray", "local:0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("argument --ray: '0' is not a positive integer")
