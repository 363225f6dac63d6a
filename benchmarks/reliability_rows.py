"""Rows for docs/results.md's reliability section, filled from one run of gpu_session.sh's steps
sanitize4, soak and faults4 (every number read from that run's files, none typed in).

    python benchmarks/reliability_rows.py OUT

Reads OUT/sanitize4/summary.txt and its driver-<tool>.json and ipc4-<tool>.json, OUT/soak.json
and OUT/faults.json (whichever exist) and prints Markdown: the sanitizer rows in the table's
columns (tool | over | result | time), the soak's line and the faults' table.
"""
from __future__ import annotations

import json
import os
import re
import sys


def _load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def sanitizer_rows(out: str) -> list[str]:
    folder = os.path.join(out, "sanitize4")
    try:
        with open(os.path.join(folder, "summary.txt")) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    rows = []
    for ln in lines:
        m = re.match(r"(memcheck|racecheck|synccheck) (driver|ipc x4)[^:]*: rc=(\S+) (\S+)s: (.*)", ln)
        if not m:
            continue
        tool, over, rc, secs, rest = m.groups()
        d = _load(os.path.join(folder, f"{'driver' if over == 'driver' else 'ipc4'}-{tool}.json"))
        if over == "driver":
            what = "benchmarks/gpu_collectives_driver.py --quick"
            if d:
                what += (f" ({d['programs']} programs on {','.join(map(str, d['ranks']))} GPUs of one process, "
                         f"{d['checks']} calls checked against lax, {len(d['failed_programs'])} failed)")
        else:
            what = "the IPC self-test, 4 processes, one GPU each (IPC_SELFTEST_QUICK=2)"
            if d:
                what += f" ({sum(p.get('checks', 0) for p in d['processes'])} checks, ok: {d['ok']})"
        result = rest.replace("; ", ", ")
        if rc not in ("0", "1"):
            result += f" (exit {rc}: 124 = stopped at its time limit)"
        rows.append(f"| {tool} | {what} | {result} | {secs} s |")
    return rows


def _size(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n / 1024:g} KiB"


def soak_line(out: str) -> str | None:
    r = _load(os.path.join(out, "soak.json"))
    if not r:
        return None
    m = r["memory"]

    def dev(s):
        return sum(d.get("bytes_in_use", 0) for d in s["devices"]) / (1 << 20)

    def pinned(s):
        return s["executor"].get("pinned_host_bytes", 0) / (1 << 20)

    def rss(s):
        return s["process"].get("VmRSS_kib", 0) / 1024
    return (f"Soak ({r['device_kind']} x{r['devices']}, jax {r['jax']}, {r['date']}, `benchmarks/gpu_soak.py "
            f"--duration {r['duration_s']:g}`): {r['seconds']} s, {r['iterations']} programs run, {r['calls']} "
            f"collective calls checked against lax ({r['steady']['calls']} in the steady phase), "
            f"{r['distinct_sizes']} sizes up to {_size(r['largest_bytes'])} per rank, errors: {r['errors']}. "
            f"Measured memory before / after the steady phase: XLA device memory in use {dev(m['before']):.1f} / "
            f"{dev(m['after']):.1f} MiB (all devices), the executor's pinned host memory {pinned(m['before']):.1f} / "
            f"{pinned(m['after']):.1f} MiB, process RSS {rss(m['before']):.0f} / {rss(m['after']):.0f} MiB.")


def fault_rows(out: str) -> list[str]:
    r = _load(os.path.join(out, "faults.json"))
    if not r:
        return []
    rows = [f"Faults ({r['platform']}, {r['processes']} processes for the IPC cases: {r['layout']}; budget "
            f"{r['timeout_s']:g} s per wait, set-up {r['setup_timeout_s']:g} s; {r['date']}; "
            "`benchmarks/gpu_faults.py`):", "",
            "| fault | what happened | measured time to the first error | error names the faulty rank | "
            "new call after reset() |", "| --- | --- | --- | --- | --- |"]
    for c in r["cases"]:
        t = c.get("time_to_error_s")
        rows.append(f"| {c['case']}: {c.get('fault', '')} | {c.get('what', '')} | "
                    f"{f'{t} s' if t is not None else 'none'} | {'yes' if c.get('error_names_faulty_rank') else 'no'} | "
                    f"{'right' if c.get('recovered') else 'FAILED'} |")
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python benchmarks/reliability_rows.py OUT  (the folder gpu_session.sh wrote)", file=sys.stderr)
        return 2
    out = argv[0]
    printed = False
    rows = sanitizer_rows(out)
    if rows:
        print("| tool | over | result | time |\n| --- | --- | --- | --- |")
        print("\n".join(rows) + "\n")
        printed = True
    line = soak_line(out)
    if line:
        print(line + "\n")
        printed = True
    rows = fault_rows(out)
    if rows:
        print("\n".join(rows))
        printed = True
    if not printed:
        print(f"no sanitize4/summary.txt, soak.json or faults.json under {out}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
