"""The tuning result store: SQLite in WAL mode, one row per measured (or rejected) candidate.

Location: --db, else $FLASHKERN_TUNE_DB, else <user cache dir>/flashkern/tuning.sqlite3.

A row's key is everything its figure depends on: operator, implementation, config, shape key,
dtypes, device identity and versions (torch, triton, tilelang, flashkern and a hash of the
kernel's source). Rows whose device or versions differ from the running ones are kept but never
used for dispatch. Each row is written in its own transaction, so a sweep killed at any moment
loses no finished result, and concurrent tuners (WAL, busy timeout) both keep all of theirs.
Decisions (the winner per shape) are rows of their own, keyed the same way by the versions of
every candidate that competed. Timed rows carry the median, the IQR (the spread) and the torch
thread count they were timed at (flashkern.autotune.timing).

Schema upgrades happen in place when a store is opened: each new version's columns are added
(ALTER TABLE ADD COLUMN, in one transaction), so earlier rows keep every value and hold NULL in
the new columns: schema 2 added `iqr` and `threads` to results and decisions, NULL for rows
timed before spreads and thread counts were recorded. A store of a newer schema is refused.

A store that SQLite cannot read raises StoreError saying where it is and how to get out:
nothing is deleted or overwritten; `flashkern store quarantine` moves it aside.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ENV_VAR = "FLASHKERN_TUNE_DB"
SCHEMA = 2

_TABLES = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (
    op TEXT NOT NULL, impl TEXT NOT NULL, config TEXT NOT NULL, shape TEXT NOT NULL, dtypes TEXT NOT NULL,
    device TEXT NOT NULL, versions TEXT NOT NULL,
    spec TEXT NOT NULL, sizes TEXT NOT NULL, is_default INTEGER NOT NULL,
    status TEXT NOT NULL, reason TEXT NOT NULL,
    median REAL, low REAL, high REAL, reps INTEGER,
    registers INTEGER, spills INTEGER, smem INTEGER,
    bytes REAL NOT NULL, flops REAL NOT NULL,
    created REAL NOT NULL, iqr REAL, threads INTEGER,
    PRIMARY KEY (op, impl, config, shape, dtypes, device, versions)
);
CREATE TABLE IF NOT EXISTS decisions (
    op TEXT NOT NULL, shape TEXT NOT NULL, dtypes TEXT NOT NULL, device TEXT NOT NULL, versions TEXT NOT NULL,
    spec TEXT NOT NULL, sizes TEXT NOT NULL,
    impl TEXT NOT NULL, config TEXT NOT NULL, median REAL NOT NULL, reason TEXT NOT NULL,
    created REAL NOT NULL, iqr REAL, threads INTEGER,
    PRIMARY KEY (op, shape, dtypes, device, versions)
);
"""

# Schema N: the statements that bring a store of schema N - 1 to N (columns added; existing rows get NULL)
_UPGRADES = {
    2: [f"ALTER TABLE {table} ADD COLUMN {column}" for table in ("results", "decisions")
        for column in ("iqr REAL", "threads INTEGER")],
}

# Result statuses
OK = "ok"  # correct and timed
CHECKED = "checked"  # correct, not timed (interpreted Triton: a correctness path, never a winner)
INCORRECT = "incorrect"  # failed the correctness gate
BUILD_FAILED = "build_failed"
PRUNED = "pruned"  # builds, but breaks a target limit (spills, shared memory)
ERROR = "error"  # raised while running


class StoreError(RuntimeError):
    """The store cannot be used; the message says where it is and what to do."""


def default_path() -> Path:
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("flashkern")) / "tuning.sqlite3"


def canonical(config: dict) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Key:
    """What a measurement depends on."""

    op: str
    impl: str
    config: str  # canonical JSON
    shape: str
    dtypes: str
    device: str
    versions: str  # canonical JSON of library versions and the kernel source hash


@dataclass(frozen=True)
class Result:
    key: Key
    spec: str  # the problem's specialization: what must match exactly for a table lookup
    sizes: tuple[int, ...]  # the sizes a table buckets on
    is_default: bool
    bytes: float  # what the operator must move (its cost model), for GB/s and rooflines
    flops: float
    status: str
    reason: str = ""
    median: float | None = None
    low: float | None = None
    high: float | None = None
    reps: int | None = None
    iqr: float | None = None  # seconds; None: timed before schema 2 recorded spreads
    threads: int | None = None  # torch threads while timing; None: timed before schema 2
    registers: int | None = None
    spills: int | None = None
    smem: int | None = None
    created: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Decision:
    op: str
    shape: str
    dtypes: str
    device: str
    versions: str  # the versions of every candidate that competed
    spec: str
    sizes: tuple[int, ...]
    impl: str
    config: str
    median: float
    reason: str
    iqr: float | None = None  # of the winner's timing in the final interleaved re-time; None before schema 2
    threads: int | None = None  # torch threads of that re-time; None before schema 2
    created: float = field(default_factory=time.time)


def _corrupt(path: Path, exc: Exception) -> StoreError:
    return StoreError(
        f"the tuning store {path} cannot be read ({exc}). Nothing was changed. Either move it aside with "
        f"`flashkern store quarantine --db {path}` (it is renamed, not deleted) or use another store with "
        f"--db PATH or ${ENV_VAR}=PATH."
    )


class Store:
    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
            self._db.execute("PRAGMA busy_timeout = 60000")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: committed rows survive a killed process
            self._db.executescript(_TABLES)
            self._upgrade()
        except sqlite3.DatabaseError as exc:
            raise _corrupt(self.path, exc) from exc

    def _schema(self) -> int | None:
        """The store's schema version (None: a new store); refuses a newer one."""
        row = self._db.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
        if row is not None and int(row[0]) > SCHEMA:
            raise StoreError(f"the tuning store {self.path} has schema {row[0]}, newer than this flashkern reads "
                             f"({SCHEMA}); upgrade flashkern or use another store with --db PATH or ${ENV_VAR}=PATH")
        return None if row is None else int(row[0])

    def _upgrade(self) -> None:
        """Stamp a new store with SCHEMA, or bring an older one up to it in place, in one transaction (a
        concurrent opener waits for it, then finds the work done). A current store is only read."""
        if self._schema() == SCHEMA:
            return
        self._db.execute("BEGIN IMMEDIATE")
        try:
            version = self._schema()
            if version is None:
                self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA),))
            else:
                for target in range(version + 1, SCHEMA + 1):
                    for statement in _UPGRADES[target]:
                        self._db.execute(statement)
                self._db.execute("UPDATE meta SET value = ? WHERE name = 'schema'", (str(SCHEMA),))
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _execute(self, sql: str, params=()):
        try:
            return self._db.execute(sql, params)
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
                raise
            raise _corrupt(self.path, exc) from exc

    # ------------------------------------------------------------ results

    def put(self, result: Result) -> None:
        """Insert or replace one result (its own transaction)."""
        row = {**asdict(result.key), **{k: v for k, v in asdict(result).items() if k != "key"}}
        row["sizes"] = json.dumps(list(result.sizes))
        row["is_default"] = int(result.is_default)
        columns = ", ".join(row)
        self._execute(f"INSERT OR REPLACE INTO results ({columns}) VALUES ({', '.join('?' * len(row))})",
                      tuple(row.values()))

    def get(self, key: Key) -> Result | None:
        rows = self._results("WHERE op=? AND impl=? AND config=? AND shape=? AND dtypes=? AND device=? AND versions=?",
                             tuple(asdict(key).values()))
        return rows[0] if rows else None

    def results(self, op: str | None = None, device: str | None = None) -> list[Result]:
        return self._results(*_where(op=op, device=device))

    def _results(self, where: str, params: tuple) -> list[Result]:
        cursor = self._execute(f"SELECT * FROM results {where} ORDER BY created", params)
        names = [d[0] for d in cursor.description]
        out = []
        for values in cursor.fetchall():
            row = dict(zip(names, values))
            key = Key(**{k: row.pop(k) for k in Key.__dataclass_fields__})
            row["sizes"] = tuple(json.loads(row["sizes"]))
            row["is_default"] = bool(row["is_default"])
            out.append(Result(key=key, **row))
        return out

    # ------------------------------------------------------------ decisions

    def decide(self, decision: Decision) -> None:
        row = asdict(decision)
        row["sizes"] = json.dumps(list(decision.sizes))
        self._execute(f"INSERT OR REPLACE INTO decisions ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                      tuple(row.values()))

    def decisions(self, op: str | None = None, device: str | None = None) -> list[Decision]:
        where, params = _where(op=op, device=device)
        cursor = self._execute(f"SELECT * FROM decisions {where} ORDER BY created", params)
        names = [d[0] for d in cursor.description]
        out = []
        for values in cursor.fetchall():
            row = dict(zip(names, values))
            row["sizes"] = tuple(json.loads(row["sizes"]))
            out.append(Decision(**row))
        return out


def _where(**equal) -> tuple[str, tuple]:
    """A WHERE clause matching the given columns (None: any value)."""
    wanted = {column: value for column, value in equal.items() if value is not None}
    clause = ("WHERE " + " AND ".join(f"{column} = ?" for column in wanted)) if wanted else ""
    return clause, tuple(wanted.values())


def quarantine(path: str | os.PathLike) -> Path:
    """Move an unreadable store (and its WAL files) aside under a timestamped name; returns the new path."""
    path = Path(path)
    target = path.with_name(f"{path.name}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
    for suffix in ("", "-wal", "-shm"):
        src = Path(str(path) + suffix)
        if src.exists():
            src.rename(Path(str(target) + suffix))
    return target
