"""Perf JSON records (one per run, schema ``exactdit.perf/1``: docs/harness.md lists the fields) and
``compare`` (Markdown table of end-to-end / per-stage deltas). Stages that do not apply to a run (the
demo has no text encoder or VAE) are ``null``.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

SCHEMA = "exactdit.perf/1"
STAGES = ("text_encoding_s", "denoising_s", "decoding_s")


# ------------------------------------------------------------------------------------------- JSON


def _sanitize(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {str(k): _sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_sanitize(v) for v in obj]
    return obj if obj is None or isinstance(obj, (str, int, float, bool)) else str(obj)  # Paths, dtypes: str


def write_json(path: str | Path, obj: Any) -> Path:
    """Strict JSON (inf/nan written as strings), indented, trailing newline."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_sanitize(obj), indent=2, allow_nan=False) + "\n")
    return path


# ------------------------------------------------------------------------------------ environment


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    import torch

    from ._api import version as exactdit_version

    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            **{dist: _version(dist) for dist in ("triton", "diffusers", "transformers")},
            "exactdit": exactdit_version()}


def device_info(device) -> dict:
    import torch

    dev = torch.device(device)
    info: dict[str, Any] = {"type": dev.type, "cpu": platform.processor() or platform.machine(),
                            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "platform": platform.platform()}
    if dev.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(dev.index if dev.index is not None else torch.cuda.current_device())
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    total_memory_bytes=int(props.total_memory), count=torch.cuda.device_count())
    else:
        info["name"] = info["cpu"] or "cpu"
    return info


def _git(*args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), *args], capture_output=True,
                              text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None


def git_commit() -> str | None:
    """Commit of the exactdit checkout (``EXACTDIT_GIT_COMMIT`` overrides), or None if unknown."""
    env = os.environ.get("EXACTDIT_GIT_COMMIT")
    if env:
        return env
    head = _git("rev-parse", "HEAD")
    if head is None or head.returncode != 0:
        return None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return head.stdout.strip() + ("-dirty" if status is not None and status.stdout.strip() else "")


def _on_cuda(device) -> bool:
    import torch

    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def reset_peak_memory(device) -> None:
    if _on_cuda(device):
        import torch

        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device) -> int | None:
    if _on_cuda(device):
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    return None


def make_record(*, label: str, kind: str, device, total_s: float, steps_s: list[float], stages: dict | None = None,
                args: dict | None = None, report: dict | None = None, outputs: dict | None = None,
                peak_gpu_memory_bytes: int | None = None) -> dict:
    st = {k: None for k in STAGES}
    st.update(stages or {})
    return {
        "schema": SCHEMA,
        "label": label,
        "kind": kind,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(sys.argv),
        "args": dict(args or {}),
        "device": device_info(device),
        "versions": versions(),
        "git_commit": git_commit(),
        "timings": {"total_s": float(total_s), "stages": st, "steps_s": [float(x) for x in steps_s]},
        "peak_gpu_memory_bytes": peak_gpu_memory_bytes,
        "exactdit_report": dict(report or {}),
        "outputs": dict(outputs or {}),
    }


def write_record(out, label: str, **fields) -> Path:
    """A :func:`make_record` written as ``perf_<label>.json`` into a StagedOutput; returns its final path."""
    write_json(out.path(f"perf_{label}.json"), make_record(label=label, **fields))
    return out.final(f"perf_{label}.json")


# ---------------------------------------------------------------------------------------- compare


class PerfFileError(ValueError):
    pass


def load_record(path: str | Path) -> dict:
    path = Path(path)
    try:
        rec = json.loads(path.read_text())
    except FileNotFoundError:
        raise PerfFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise PerfFileError(f"{path}: is a folder, not a perf JSON file") from None
    except UnicodeDecodeError:  # e.g. a PNG given by mistake
        raise PerfFileError(f"{path}: not a JSON file (not UTF-8 text)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise PerfFileError(f"{path}: not a readable JSON file ({exc})") from None
    problem = schema_problem(rec)
    if problem is not None:
        raise PerfFileError(f"{path}: not an exactdit perf JSON ({problem})")
    return rec


def _show(v) -> str:
    """A value as JSON, cut short so the error stays on one line."""
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def schema_problem(rec) -> str | None:
    """The first way ``rec`` breaks the perf JSON schema in a field ``compare`` reads, or None.
    The one check for every record, so a bad value is refused with its name instead of shown as "–"."""
    if not isinstance(rec, dict):
        return f"holds a JSON {type(rec).__name__}, not an object"
    if rec.get("schema", SCHEMA) != SCHEMA:
        return f"schema {_show(rec['schema'])}, expected {SCHEMA}"
    t = rec.get("timings")
    if not isinstance(t, dict):
        return "no timings object"
    total = t.get("total_s")
    if not _is_num(total) or total <= 0:
        return f"timings.total_s must be a positive number of seconds, got {_show(total)}"
    stages = t.get("stages")
    if stages is not None and not isinstance(stages, dict):
        return f"timings.stages must be an object, got {_show(stages)}"
    for name, v in (stages or {}).items():
        if v is not None and not (_is_num(v) and v >= 0):
            return f"timings.stages.{name} must be null or a number of seconds >= 0, got {_show(v)}"
    steps = t.get("steps_s")
    if steps is not None and not (isinstance(steps, list) and all(_is_num(x) and x >= 0 for x in steps)):
        return f"timings.steps_s must be a list of seconds >= 0, got {_show(steps)}"
    mem = rec.get("peak_gpu_memory_bytes")
    if mem is not None and not (_is_num(mem) and mem >= 0):
        return f"peak_gpu_memory_bytes must be null or a number >= 0, got {_show(mem)}"
    if rec.get("label") is not None and not isinstance(rec["label"], str):
        return f"label must be a string, got {_show(rec['label'])}"
    if rec.get("device") is not None and not isinstance(rec["device"], dict):
        return f"device must be an object, got {_show(rec['device'])}"
    return None


def metrics_of(rec: dict) -> dict[str, float | None]:
    # ``rec`` passed schema_problem: every value read here is null, absent or a number
    t = rec["timings"]
    stages = t.get("stages") or {}
    steps = [float(x) for x in t.get("steps_s") or []]
    mem = rec.get("peak_gpu_memory_bytes")
    values = {"end-to-end (s)": t.get("total_s"), "text encoding (s)": stages.get("text_encoding_s"),
              "denoising (s)": stages.get("denoising_s"), "decoding (s)": stages.get("decoding_s"),
              "per step, mean (s)": statistics.fmean(steps) if steps else None,
              "per step, median (s)": statistics.median(steps) if steps else None,
              "peak GPU memory (MiB)": mem / 2**20 if mem is not None else None}
    return {k: float(v) if v is not None else None for k, v in values.items()}


def _cell(v: float | None, base: float | None) -> str:
    if v is None:
        return "–"
    s = f"{v:.4f}" if abs(v) < 100 else f"{v:.1f}"
    if base is None or base == 0:
        return s
    pct = (v - base) / base * 100.0
    speed = base / v if v else math.inf
    return f"{s} ({pct:+.1f}%, {speed:.2f}x)"


def column_names(paths: list[str | Path]) -> list[str]:
    """Column names that tell the files apart: the file name, or as many trailing folders as it takes
    (two runs' ``perf_patched.json`` become ``demo/perf_patched.json`` and ``gen/perf_patched.json``)."""
    parts = [Path(os.path.abspath(Path(p).expanduser())).parts for p in paths]
    longest = max(len(x) for x in parts)
    for k in range(1, longest + 1):
        names = [str(Path(*x[-k:])) for x in parts]
        if len(set(names)) == len(names):
            return names
    names = [str(Path(p)) for p in paths]  # the same file more than once
    return [f"{n} [{i + 1}]" for i, n in enumerate(names)]


def run_identity(rec: dict) -> dict[str, str | None]:
    """What must match for two runs' timings to be comparable (None where a record does not say)."""
    args = rec.get("args") if isinstance(rec.get("args"), dict) else {}
    model = args.get("model")
    model = f"{model} config={args.get('config')}" if model else args.get("model_path")
    h, w, f = args.get("height"), args.get("width"), args.get("num_frames")
    size = f"{h}x{w}" + (f"x{f}" if f else "") if h and w else None
    dev = rec.get("device") or {}
    device = f"{dev.get('type')} ({dev.get('name')})" if dev.get("type") or dev.get("name") else None
    ident = {"run": rec.get("kind"), "model": model, "size": size, "steps": args.get("steps"),
             "dtype": args.get("dtype"), "device": device}
    return {k: (str(v) if v is not None else None) for k, v in ident.items()}


def differences(recs: list[dict], names: list[str]) -> list[str]:
    """One phrase per property (run kind, model, size, steps, dtype, device) the runs differ in."""
    idents = [run_identity(r) for r in recs]
    out = []
    for key in idents[0]:
        values = [i[key] for i in idents]
        if len({v for v in values if v is not None}) > 1:
            out.append(f"{key} (" + ", ".join(f"{n}: {v if v is not None else '?'}"
                                              for n, v in zip(names, values)) + ")")
    return out


def compare(paths: Iterable[str | Path], force: bool = False) -> str:
    """Markdown table: one column per perf JSON, the first is the baseline; later columns show the value,
    the relative change and the speedup (baseline / value) for each metric.

    Runs that differ in kind (demo / generate), model, size, steps, dtype or device are refused
    (``PerfFileError``) unless ``force``; then the table says how they differ."""
    paths = list(paths)
    if len(paths) < 2:
        raise PerfFileError("compare needs at least two perf JSON files (baseline first)")
    recs = [load_record(p) for p in paths]
    names = column_names(paths)
    diffs = differences(recs, names)
    if diffs and not force:
        raise PerfFileError("the runs differ in " + "; ".join(diffs)
                            + ", so their timings are not comparable; pass --force to compare them anyway")
    cols = [metrics_of(r) for r in recs]
    header = " | ".join(f"{n} ({r['label']})" if r.get("label") else n for r, n in zip(recs, names))
    lines = [f"| metric | {header} |", "|---|" + "---|" * len(recs)]
    for key in cols[0]:
        if all(c[key] is None for c in cols):
            continue
        base = cols[0][key]
        cells = [_cell(base, None)] + [_cell(c[key], base) for c in cols[1:]]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    notes = [f"note: the runs differ in {d}" for d in diffs]
    cpu = [n for r, n in zip(recs, names) if (r.get("device") or {}).get("type") == "cpu"]
    if cpu:
        notes.append(f"note: {', '.join(cpu)} ran on the CPU, where exactdit's fused kernels do not run: "
                     f"no speedup there is exactdit's")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"
