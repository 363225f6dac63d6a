"""One line per compute-sanitizer log: its error count, split into findings in jax_blink's kernels,
findings in other kernels (XLA's, NCCL's) and CUDA API errors.

    python benchmarks/sanitizer_summary.py LABEL LOG [RC SECONDS]

compute-sanitizer prints each finding as a line ``========= <what>`` followed by indented
``=========     at ...`` lines that name the kernel, and per process an ``ERROR SUMMARY: N errors``
(racecheck: ``RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)``); with
``--target-processes all`` every process has its own summary, which this sums. Our kernels live in
namespace ``jax_blink`` (kernels/cuda/*.cuh, ipc.cu), so a kernel name holding "jax_blink" is ours.
"""
from __future__ import annotations

import collections
import re
import sys

_PREFIX = "========= "
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?$")  # not "... N errors were not printed"
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
_KERNEL = re.compile(r"(?:\bat|^Device Frame:) (.+?)\+0x[0-9a-fA-F]+")


def _kernel_name(frame: str) -> str | None:
    """``at ns::(anonymous namespace)::k(Params)+0x1a30`` (or ``Device Frame: ...``) -> ``ns::(anonymous namespace)::k``."""
    m = _KERNEL.search(frame)
    if not m:
        return None
    name = m.group(1).strip()
    if name.endswith(")"):  # drop the parameter list: from its matching "(" on
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    return name
_INFO = ("COMPUTE-SANITIZER", "Target application returned", "ERROR SUMMARY", "RACECHECK SUMMARY",
         "LEAK SUMMARY", "Saved host backtrace", "Host Frame", "Device Frame", "Error: process didn't terminate",
         "No kernels were profiled", "Note:", "Warning: Detected overflow")


def parse(text: str) -> dict:
    """Counts of one log: summaries, findings by (ours or not, kind, kernel), API errors by kind."""
    entries: list[list[str]] = []
    for line in text.splitlines():
        if not line.startswith(_PREFIX.rstrip()):
            continue
        body = line[len(_PREFIX):] if line.startswith(_PREFIX) else ""
        if body and not body.startswith(" "):
            entries.append([body.strip()])
        elif entries and body:
            entries[-1].append(body.strip())
    summary_errors = processes = 0
    race = [0, 0, 0]
    findings: collections.Counter = collections.Counter()
    api: collections.Counter = collections.Counter()
    for head, *rest in entries:
        m = _SUMMARY.search(head)
        if m:
            summary_errors += int(m.group(1))
            processes += 1
            continue
        m = _RACE_SUMMARY.search(head)
        if m:
            race = [a + int(b) for a, b in zip(race, m.groups())]
            processes += 1
            continue
        if head.startswith("Program hit"):
            api[re.sub(r" \(error \d+\).*", "", head[len("Program hit "):])] += 1
            continue
        if head.startswith(_INFO):
            continue
        kernel = "?"
        # The outermost device frame is the __global__ kernel: the "at" frame may be an inlined
        # intrinsic (__ldcg) of it. Racecheck names the kernel in the head line.
        device = [f for f in rest if f.startswith("Device Frame:")]
        for frame in device[-1:] or [head, *rest]:
            name = _kernel_name(frame) if not frame.startswith(("Host Frame", "Saved host")) else None
            if name:
                kernel = name
                break
        kind = re.sub(r"\s+(of size|at|in)\b.*", "", head)[:80]
        findings[("jax_blink" in kernel, kind, kernel[:100])] += 1
    return {"summary_errors": summary_errors, "processes": processes, "race": race,
            "findings": findings, "api": api}


def line(label: str, text: str, rc: str = "?", seconds: str = "?") -> str:
    """The one-line summary of one log."""
    p = parse(text)
    ours = {k: v for k, v in p["findings"].items() if k[0]}
    other = {k: v for k, v in p["findings"].items() if not k[0]}

    def top(counter, n=3):
        items = sorted(counter.items(), key=lambda kv: -kv[1])[:n]
        return ", ".join(f"{v}x {k[1]} in {k[2]}" if isinstance(k, tuple) else f"{v}x {k}" for k, v in items)

    parts = [f"{label}: rc={rc} {seconds}s: {p['summary_errors']} errors (sum of {p['processes']} summaries)"]
    if p["processes"] == 0:
        parts.append("NO SUMMARY (killed at its time limit or did not start?)")
    if any(p["race"]):
        parts.append(f"racecheck {p['race'][0]} hazards ({p['race'][1]} errors, {p['race'][2]} warnings)")
    parts.append(f"in jax_blink kernels: {sum(ours.values())}" + (f" [{top(ours)}]" if ours else ""))
    parts.append(f"in other kernels: {sum(other.values())}" + (f" [{top(other)}]" if other else ""))
    parts.append(f"CUDA API errors: {sum(p['api'].values())}" + (f" [{top(p['api'])}]" if p["api"] else ""))
    return "; ".join(parts)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 4):
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    try:
        with open(argv[1], errors="replace") as f:
            text = f.read()
    except OSError as e:
        print(f"{argv[0]}: no log ({e})")
        return 1
    print(line(argv[0], text, *(argv[2:4] or ["?", "?"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
