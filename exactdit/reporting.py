"""``exactdit.report()``: what ran fused, what ran eager and why, per op and per captured graph,
then what the engine did to each graph. Reads the gate's counters and the engine's coverage."""

from __future__ import annotations

import re
from collections import Counter

from exactdit import first_calls, gate
from exactdit.engine import capture_cache, coverage

REGION_SUFFIX = re.compile(r"\.r\d+$")


def group_name(name: str) -> str:
    """The row an op's counts are shown under: engine regions (``<graph>.r<k>``) under their graph."""
    return REGION_SUFFIX.sub("", name)


def grouped(report: dict) -> dict:
    """``report``'s entries summed per :func:`group_name` (fused, eager, reasons, signatures)."""
    out: dict = {}
    for name, e in report.items():
        g = out.setdefault(group_name(name), {"fused": 0, "eager": 0, "eager_reasons": Counter(), "verified": 0,
                                              "disabled": 0, "regions": 0})
        g["fused"] += e["fused"]
        g["eager"] += e["eager"]
        g["eager_reasons"].update(e["eager_reasons"])
        g["verified"] += len(e.get("verified", ()))
        g["disabled"] += len(e.get("disabled", ()))
        g["regions"] += 1 if REGION_SUFFIX.search(name) else 0
    return out


class Report(dict):
    """``{op name: {"fused", "eager", "eager_reasons", "verified", "disabled"}}``; prints as a
    table (engine regions summed per captured graph), then what the engine did to each graph and
    where its first calls spent their time. ``first_calls``: block class -> phase -> (seconds,
    count) (:mod:`exactdit.first_calls`)."""

    first_calls: dict = {}

    def __str__(self) -> str:
        if not self:
            return "\n".join(["exactdit: no op has been called yet"] + first_calls.lines(self.first_calls)
                             + capture_cache.lines())
        rows = [("op / captured graph", "fused", "eager", "verified", "disabled", "eager because")]
        for name, e in sorted(grouped(self).items()):
            why = ", ".join(f"{r} x{n}" for r, n in e["eager_reasons"].items()) or "-"
            label = f"{name} ({e['regions']} regions)" if e["regions"] else name
            rows.append((label, str(e["fused"]), str(e["eager"]), str(e["verified"]), str(e["disabled"]), why))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        for name, e in sorted(self.items()):
            for sig, why in e["disabled"].items():
                lines.append(f"disabled {name} {sig}: {why}")
        for name, e in sorted(self.items()):
            if "graphed" in e:
                lines.append(f"CUDA graphs of {name.split('.', 1)[-1]}: {e['graphed']}"
                             + (f" ({e['graphed_why']})" if e.get("graphed_why") else ""))
        for label, why in sorted(coverage.in_parts().items()):
            lines.append(f"captured in parts (graph breaks): {label}: {why}")
        for graph in coverage.graphs():
            lines.extend(graph.lines())
        lines.extend(first_calls.lines(self.first_calls))
        lines.extend(capture_cache.lines())
        return "\n".join(lines)

    __repr__ = __str__


def report(show: bool = True) -> Report:
    """Per op: fused and eager call counts, why calls ran eager, verified and disabled
    signatures. Prints the table when ``show``."""
    result = Report(gate.snapshot())
    result.first_calls = first_calls.snapshot()
    if show:
        print(result)
    return result


def reset_report() -> None:
    """Zero the call counters; verified and disabled signatures are kept."""
    gate.reset_counts()
