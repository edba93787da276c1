"""``plancache sql``: one read-only SQL query on the store, for scripts, printed as it is
read (a table, JSON or CSV). The one user of sqlite-utils, imported inside the command:
neither the library nor the other commands pay for it."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import sqlite3
import sys
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import click

from ..errors import PlanCacheError
from .common import Command, Context, emit, table

__all__ = ["SQL_VIEWS", "TABLE_BLOCK", "sql"]


#: Views ``plancache sql`` adds for scripts, so that they need not decode the JSON columns
#: of ``plans``. They are TEMP views of the command's own read-only connection: the store
#: is never changed, and an older plancache reads it as before.
SQL_VIEWS: dict[str, str] = {
    "entries": "SELECT key, env_id, label, json_extract(environment_json, '$.gpu_name') AS gpu, "
               "json_extract(engine_json, '$.name') AS engine, policy, backend, length(blob) AS blob_size, workspace_size, "
               "build_seconds, autotune_seconds, hit_count, datetime(created_at, 'unixepoch') AS created, "
               "datetime(last_used_at, 'unixepoch') AS last_used FROM plans",
    "quarantined": "SELECT id, key, reason, datetime(quarantined_at, 'unixepoch') AS quarantined, length(blob) AS blob_size "
                   "FROM quarantine",
}  # fmt: skip


def _empty_schema() -> sqlite3.Connection:
    """The tables of a store with nothing in it, in memory: a cache that does not exist yet
    is queried as an empty one."""
    from ..store import migrations

    conn = sqlite3.connect(":memory:", isolation_level=None)
    for _number, _name, script in migrations():
        conn.executescript(script)
    return conn


def _cell(value: Any, *, as_json: bool) -> Any:
    """A value of a row as printed: a blob by its size (or base64 in JSON, as sqlite-utils
    writes it)."""
    if isinstance(value, bytes):
        if as_json:
            import base64

            return {"$base64": True, "encoded": base64.b64encode(value).decode()}
        return f"<{len(value)} bytes>"
    return value


@click.command(cls=Command)
@click.argument("query", required=False)
@click.option("-p", "--param", "params", nargs=2, multiple=True, metavar="NAME VALUE",
              help="A value for :NAME in QUERY (repeatable).")  # fmt: skip
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV, with a header row.")
@click.pass_obj
def sql(obj: Context, query: str | None, params: tuple[tuple[str, str], ...], as_csv: bool) -> None:
    """Run a read-only SQL QUERY on the store and print its rows (a table, --json or --csv);
    without QUERY, list the tables and views with their columns and rows.

    Besides the store's tables (plans, quarantine, counters, kernel_caches, app_plans) two
    views read well from scripts: entries (one row per plan: key, env_id, label, gpu,
    engine, policy, backend, blob_size, workspace_size, build_seconds, autotune_seconds,
    hit_count, created, last_used) and quarantined. The store is opened read-only: a query
    that would change it fails. For example:

        plancache sql "SELECT label, engine, hit_count FROM entries ORDER BY hit_count DESC LIMIT 5"
    """
    import sqlite_utils  # the one user of sqlite-utils: off the library's import path and the other commands'

    with (
        obj.reading(read_only=True) as store,
        contextlib.closing(sqlite_utils.Database(store.connection() if store is not None else _empty_schema())) as db,
    ):
        # The views live in this connection's temporary schema, never in plans.db; the
        # store's query_only guard (see Store.connection) is lifted only while they are made.
        db.execute("PRAGMA query_only = OFF")
        for name, select in SQL_VIEWS.items():
            db.execute(f"CREATE TEMP VIEW {name} AS {select}")
        db.execute("PRAGMA query_only = ON")
        # query_only refuses writes to tables, not a pragma that changes the file (a journal
        # mode, say): the user's query may read, and ask the pragmas that only read. Opening
        # the file read-only (a mode=ro URI) would not do instead: such a connection still
        # runs ATTACH, which creates the file it names, and functions with side effects
        # (sqlite_log, fts3_tokenizer), and leaves -wal and -shm beside plans.db when it closes.
        refused: list[str] = []  # what the authorizer refused, to say so (SQLite says only "not authorized")
        db.conn.set_authorizer(functools.partial(_reads_only, refused))
        if query is None:
            names = [*(n for n in db.table_names() if not n.startswith("sqlite_")), *SQL_VIEWS]
            data: list[dict[str, Any]] = [{"name": name, "kind": "view" if name in SQL_VIEWS else "table",
                                           "columns": [d[0] for d in db.execute(f"SELECT * FROM [{name}] LIMIT 0").description],
                                           "rows": db[name].count} for name in names]  # fmt: skip
            emit(data, lambda d: (f"{t['kind']:5} {t['name']:14} {t['rows']:>7} rows  {', '.join(t['columns'])}" for t in d))
        else:  # printed as the rows come, with the store still open: a result can be larger than memory
            columns, rows = _query(db.conn, query, dict(params), refused, as_json=obj.as_json)
            if obj.as_json:
                _print_json_rows(rows)
            elif as_csv:
                _print_csv(columns, rows)
            else:
                _print_table(columns, rows)


#: What reading takes: selects, reads, recursive queries and sqlite-utils' savepoint (functions: ``_PURE``).
_READING = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE, sqlite3.SQLITE_SAVEPOINT,
                      sqlite3.SQLITE_TRANSACTION})  # fmt: skip
#: The functions a query may call: SQLite's core, date, math, JSON, aggregate and window
#: functions, which compute a value and change nothing. Left out: those with side effects
#: (load_extension loads native code, fts3_tokenizer can register one, sqlite_log writes
#: the error log) and those of full-text and R-tree tables, which plans.db has none of.
_PURE = frozenset({
    "abs", "changes", "char", "coalesce", "format", "glob", "hex", "ifnull", "iif", "instr", "last_insert_rowid",
    "length", "like", "likelihood", "likely", "lower", "ltrim", "max", "min", "nullif", "printf", "quote", "random",
    "randomblob", "replace", "round", "rtrim", "sign", "soundex", "sqlite_compileoption_get", "sqlite_compileoption_used",
    "sqlite_source_id", "sqlite_version", "substr", "substring", "total_changes", "trim", "typeof", "unicode", "unlikely",
    "upper", "zeroblob", "subtype",
    "date", "time", "datetime", "julianday", "unixepoch", "strftime", "current_date", "current_time", "current_timestamp",
    "acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "ceil", "ceiling", "cos", "cosh", "degrees", "exp",
    "floor", "ln", "log", "log10", "log2", "mod", "pi", "pow", "power", "radians", "sin", "sinh", "sqrt", "tan", "tanh",
    "trunc",
    "json", "json_array", "json_array_length", "json_extract", "->", "->>", "json_insert", "json_object", "json_patch",
    "json_quote", "json_remove", "json_replace", "json_set", "json_type", "json_valid", "json_group_array",
    "json_group_object", "json_each", "json_tree",
    "avg", "count", "group_concat", "sum", "total", "cume_dist", "dense_rank", "first_value", "lag", "last_value", "lead",
    "nth_value", "ntile", "percent_rank", "rank", "row_number",
})  # fmt: skip
#: Pragmas that only read, asked without a value (``PRAGMA table_info(plans)`` passes its
#: table as the value, and is allowed by name).
_READ_PRAGMAS = frozenset({"table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
                           "foreign_key_list", "database_list", "collation_list", "function_list", "module_list",
                           "pragma_list", "compile_options", "user_version", "schema_version", "application_id",
                           "page_count", "page_size", "freelist_count", "journal_mode", "encoding", "quick_check",
                           "integrity_check"})  # fmt: skip
_WITH_TABLE = frozenset({"table_info", "table_xinfo", "index_list", "index_info", "index_xinfo", "foreign_key_list",
                         "quick_check", "integrity_check"})  # fmt: skip


def _reads_only(
    refused: list[str], action: int, first: str | None, second: str | None, _database: str | None, _trigger: str | None
) -> int:
    """A SQLite authorizer for ``plancache sql``: reads (in sqlite-utils' savepoint), pure
    functions and pragmas that only read. What it refuses is added to ``refused``, in words."""
    if action in _READING or (action == sqlite3.SQLITE_FUNCTION and (second or "").lower() in _PURE):
        return sqlite3.SQLITE_OK
    pragma = (first or "").lower()
    reads = action == sqlite3.SQLITE_PRAGMA and pragma in _READ_PRAGMAS and (second is None or pragma in _WITH_TABLE)
    if not reads:
        refused.append(_refused_action(action, first, second))
    return sqlite3.SQLITE_OK if reads else sqlite3.SQLITE_DENY


#: SQLite's authorizer actions, by code (the sqlite3 module has them as constants only).
_ACTIONS = {getattr(sqlite3, f"SQLITE_{name}"): name.replace("_", " ").lower() for name in (
    "CREATE_INDEX", "CREATE_TABLE", "CREATE_TEMP_INDEX", "CREATE_TEMP_TABLE", "CREATE_TEMP_TRIGGER", "CREATE_TEMP_VIEW",
    "CREATE_TRIGGER", "CREATE_VIEW", "DELETE", "DROP_INDEX", "DROP_TABLE", "DROP_TEMP_INDEX", "DROP_TEMP_TABLE",
    "DROP_TEMP_TRIGGER", "DROP_TEMP_VIEW", "DROP_TRIGGER", "DROP_VIEW", "INSERT", "UPDATE", "ATTACH", "DETACH",
    "ALTER_TABLE", "REINDEX", "ANALYZE", "CREATE_VTABLE", "DROP_VTABLE") if hasattr(sqlite3, f"SQLITE_{name}")} | {
    sqlite3.SQLITE_DELETE: "delete from", sqlite3.SQLITE_INSERT: "insert into", sqlite3.SQLITE_ATTACH: "attach"}  # fmt: skip


def _refused_action(action: int, first: str | None, second: str | None) -> str:
    if action == sqlite3.SQLITE_FUNCTION:
        return f"call {second}(), which is not one of the functions it allows (those that only compute a value)"
    if action == sqlite3.SQLITE_PRAGMA:
        return f"set PRAGMA {first} = {second}" if second is not None else f"run PRAGMA {first}, which can change the file"
    what = _ACTIONS.get(action, f"run SQLite action {action}")
    return f"{what} {first}" if first else f"{what} a database (VACUUM does)" if action == sqlite3.SQLITE_ATTACH else what


def _query(
    conn: sqlite3.Connection, query: str, params: Mapping[str, str], refused: list[str], *, as_json: bool
) -> tuple[list[str], Iterator[dict[str, Any]]]:
    """The column names and the rows, as they are read, of the user's one reading statement;
    a refusal or failure in plancache's words (SQLite says only "not authorized" for a
    write, and sqlite-utils named its own methods for a statement without rows)."""

    def failed(exc: sqlite3.Error) -> PlanCacheError:
        if refused:
            return PlanCacheError(f"the query failed: it would {', '.join(dict.fromkeys(refused))}, and plancache sql only "
                                  "reads (the store is opened read-only; the other commands change it)")  # fmt: skip
        if "one statement at a time" in str(exc):
            return PlanCacheError("the query failed: it holds more than one statement; give one")
        return PlanCacheError(f"the query failed: {exc}")

    try:
        cursor = conn.execute(query, params)
    except sqlite3.Error as exc:
        raise failed(exc) from exc
    if cursor.description is None:
        raise PlanCacheError("the query failed: it returns no rows (plancache sql runs one SELECT, or a pragma that "
                             "only reads)")  # fmt: skip
    names = [column[0] for column in cursor.description]

    def rows() -> Iterator[dict[str, Any]]:
        try:
            for row in cursor:
                yield {name: _cell(value, as_json=as_json) for name, value in zip(names, row)}
        except sqlite3.Error as exc:  # a failure part-way (an error a row's value raises)
            raise failed(exc) from exc

    return names, rows()


#: Rows a table is aligned over: a longer result is printed as it is read, each block of
#: this many rows aligned on its own (a table is aligned over all of its rows, which a
#: result larger than memory cannot wait for), the header above the first.
TABLE_BLOCK = 1000


def _print_table(columns: list[str], rows: Iterator[dict[str, Any]]) -> None:
    header: Sequence[str] = columns
    for block in iter(lambda: list(itertools.islice(rows, TABLE_BLOCK)), []):
        click.echo("\n".join(table([[str(v) for v in row.values()] for row in block], header)))
        header = ()
    if header:
        click.echo("(no rows)")


def _print_json_rows(rows: Iterator[dict[str, Any]]) -> None:
    """The rows as one JSON array, written as they are read: the same text as ``emit``'s."""
    out = sys.stdout
    first = True
    for row in rows:
        out.write(("[\n" if first else ",\n") + textwrap.indent(json.dumps(row, indent=2, sort_keys=True, default=str), "  "))
        first = False
    out.write("[]\n" if first else "\n]\n")


def _print_csv(columns: list[str], rows: Iterator[dict[str, Any]]) -> None:
    import csv

    writer = None
    for row in rows:  # the header with the first row: no rows, no header
        if writer is None:
            writer = csv.DictWriter(sys.stdout, fieldnames=columns, lineterminator="\n")
            writer.writeheader()
        writer.writerow(row)
