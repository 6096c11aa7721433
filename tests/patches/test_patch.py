"""Malformed calls name the function that was called; ``unpatch`` has one result shape."""

import pytest
import torch

import exactdit


def test_unpatch_of_something_else_names_unpatch():
    with pytest.raises(TypeError, match=r"^exactdit\.unpatch: .*NoneType"):
        exactdit.unpatch(None)
    with pytest.raises(TypeError, match=r"^exactdit\.patch: .*NoneType"):
        exactdit.patch(None)


def test_unpatch_of_an_unpatched_model_says_nothing_was_restored():
    assert exactdit.unpatch(torch.nn.Linear(2, 2)) == {"restored": {}}
