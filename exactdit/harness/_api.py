"""Access to the public exactdit API (patch / unpatch / report / reset_report) from the harness.

The harness lives inside the ``exactdit`` package but must not import the kernels at module import
time (``exactdit --help`` should be instant, and the CLI must give a clear message if the API is
unavailable). Everything goes through :func:`api`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

REQUIRED = ("patch", "unpatch", "report", "reset_report")


class ExactditAPIError(RuntimeError):
    """The exactdit patching API could not be used."""


def api() -> ModuleType:
    """Return the ``exactdit`` module, checking that the patching API is present."""
    try:
        mod = importlib.import_module("exactdit")
    except Exception as exc:  # pragma: no cover - import errors of the package itself
        raise ExactditAPIError(f"cannot import exactdit: {type(exc).__name__}: {exc}") from exc
    missing = [name for name in REQUIRED if not callable(getattr(mod, name, None))]
    if missing:
        raise ExactditAPIError(
            "this exactdit build does not provide " + ", ".join(f"exactdit.{m}()" for m in missing)
        )
    return mod


def version() -> str:
    try:
        mod = importlib.import_module("exactdit")
    except Exception:  # pragma: no cover
        return "unknown"
    return str(getattr(mod, "__version__", "unknown"))


def normalize_report(rep) -> dict:
    out: dict = {}
    for op, entry in dict(rep or {}).items():
        entry = dict(entry or {})
        reasons = {str(k): int(v) for k, v in dict(entry.get("eager_reasons") or {}).items()}
        norm = {k: v for k, v in entry.items() if k not in ("fused", "eager", "eager_reasons")}
        norm = {k: v for k, v in norm.items() if isinstance(v, (int, float, str, bool, type(None)))}
        norm.update(fused=int(entry.get("fused", 0)), eager=int(entry.get("eager", 0)), eager_reasons=reasons)
        out[str(op)] = norm
    return out


def summarize_report(rep: dict) -> tuple[int, int, dict]:
    """Total fused calls, total eager calls, and merged eager reasons."""
    fused = sum(int(e.get("fused", 0)) for e in rep.values())
    eager = sum(int(e.get("eager", 0)) for e in rep.values())
    reasons: dict = {}
    for e in rep.values():
        for r, n in (e.get("eager_reasons") or {}).items():
            reasons[r] = reasons.get(r, 0) + int(n)
    return fused, eager, reasons
