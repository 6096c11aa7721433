"""Test support: a stand-in for the exactdit patching API when this checkout does not provide it yet.

If ``exactdit.patch`` etc. exist (the real API), :func:`ensure_api` leaves them alone, so the tests
exercise the real thing (on CPU every op falls back to eager). Otherwise it installs a minimal fake
through ``monkeypatch`` that counts transformer calls as eager fallbacks.
"""

from __future__ import annotations

import exactdit

_NAMES = ("patch", "unpatch", "report", "reset_report")


def has_real_api() -> bool:
    return all(callable(getattr(exactdit, n, None)) for n in _NAMES)


class FakeAPI:
    def __init__(self):
        self.counts = {"fake_op": {"fused": 0, "eager": 0, "eager_reasons": {}}}
        self.patched = {}

    def _transformer(self, obj):
        return getattr(obj, "transformer", obj)

    def patch(self, obj):
        tr = self._transformer(obj)
        orig = tr.forward
        api = self

        def forward(*args, **kwargs):
            e = api.counts["fake_op"]
            e["eager"] += 1
            e["eager_reasons"]["not on CUDA"] = e["eager_reasons"].get("not on CUDA", 0) + 1
            return orig(*args, **kwargs)

        tr.forward = forward
        self.patched[id(tr)] = (tr, orig)
        return {"patched_sites": 1, "fake": True}

    def unpatch(self, obj):
        tr = self._transformer(obj)
        if id(tr) in self.patched:
            del tr.__dict__["forward"]
            del self.patched[id(tr)]

    def report(self, show: bool = False):
        return {k: {"fused": v["fused"], "eager": v["eager"], "eager_reasons": dict(v["eager_reasons"])}
                for k, v in self.counts.items()}

    def reset_report(self):
        for v in self.counts.values():
            v.update(fused=0, eager=0, eager_reasons={})


def ensure_api(monkeypatch):
    """Make sure exactdit.patch/unpatch/report/reset_report exist; returns the fake or None."""
    if has_real_api():
        return None
    fake = FakeAPI()
    for n in _NAMES:
        monkeypatch.setattr(exactdit, n, getattr(fake, n), raising=False)
    return fake
