"""Test set-up. Kernels run in Triton's CPU interpreter unless a CUDA GPU is present; the mode
must be chosen before Triton or exactdit is imported."""

import os

import torch

if "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"

import pytest  # noqa: E402

from exactdit import state  # noqa: E402

ON_GPU = torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] != "1"
#: Where kernel tests run: the GPU when there is one, else CPU tensors through the interpreter.
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device)")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """Each test starts with nothing remembered (exactdit.state), default switches, poisoned outputs."""
    for name in ("EXACTDIT_DISABLE", "EXACTDIT_VERIFY_ALL", "EXACTDIT_TRUST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("EXACTDIT_POISON", "1")
    state.reset()
    yield
    state.reset()
