"""Runs one SQL query on DuckDB over tables loaded from raw column files, and times it.

The analytics benchmarks write each table column as a file of little-endian 64-bit
signed integers, then call (through scripts/duckdb.sh run):

    duckdb_peer.py --table r=k:/tmp/r.k,v:/tmp/r.v --table s=k:/tmp/s.k \
                   --query 'SELECT count(*), sum(r.v) FROM r JOIN s USING (k)' \
                   [--repeat 3] [--threads 2]

Tables are copied into DuckDB's own storage first (not timed), so the query runs on
native columns. The query runs once to warm up and then --repeat times. One JSON object
goes to stdout: load_ms, runs_ms (each timed run), median_ms (the lower median), threads,
version, and result (every row of the last run, as lists; keep the query's result
small).
"""

import argparse
import json
import statistics
import sys
import time

import duckdb
import numpy as np


def parse_table(spec):
    name, _, cols = spec.partition("=")
    if not name or not cols:
        raise SystemExit(f"--table {spec!r}: expected NAME=COL:PATH[,COL:PATH…]")
    columns = []
    for col in cols.split(","):
        cname, _, path = col.partition(":")
        if not cname or not path:
            raise SystemExit(f"--table {spec!r}: column {col!r} is not COL:PATH")
        columns.append((cname, path))
    return name, columns


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", action="append", default=[], help="NAME=COL:PATH[,COL:PATH…]")
    ap.add_argument("--query", required=True)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.repeat < 1:
        raise SystemExit("--repeat must be at least 1")

    con = duckdb.connect()
    con.execute(f"SET threads TO {args.threads}")
    t0 = time.perf_counter()
    for spec in args.table:
        name, columns = parse_table(spec)
        arrays = {}
        for cname, path in columns:
            try:
                arrays[cname] = np.fromfile(path, dtype="<i8")
            except OSError as e:
                raise SystemExit(f"table {name}, column {cname}: cannot read {path}: {e}")
        lengths = {len(a) for a in arrays.values()}
        if len(lengths) != 1:
            raise SystemExit(f"table {name}: columns differ in length {sorted(lengths)}")
        con.register(f"{name}_src", arrays)
        con.execute(f"CREATE TABLE {name} AS SELECT * FROM {name}_src")
        con.unregister(f"{name}_src")
    load_ms = (time.perf_counter() - t0) * 1e3

    con.execute(args.query).fetchall()  # warm-up
    runs = []
    result = None
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        result = con.execute(args.query).fetchall()
        runs.append((time.perf_counter() - t0) * 1e3)
    json.dump(
        {
            "load_ms": load_ms,
            "runs_ms": runs,
            # The lower median of an even count: a run that happened, as namdb reports
            # its own medians.
            "median_ms": statistics.median_low(runs),
            "threads": args.threads,
            "version": duckdb.__version__,
            "result": [list(row) for row in result],
        },
        sys.stdout,
    )
    print()


if __name__ == "__main__":
    main()
