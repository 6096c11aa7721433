"""The README's opening, as a new user reads it (issue 35, item 14), and the form `.ci/run` relies on."""

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _first_code_block() -> tuple[int, list[str]]:
    m = re.search(r"^```\w*\n(.*?)^```", README, re.S | re.M)
    assert m, "README has no code block"
    return m.start(), m.group(1).strip().splitlines()


def test_readme_starts_with_the_two_set_up_commands():
    start, lines = _first_code_block()
    assert len(lines) == 2, lines
    demo, tests = lines
    assert demo.startswith("pip install torch==") and demo.endswith("&& exactdit demo")
    assert tests.startswith("pip install torch==") and "pytest" in tests
    # .ci/run runs the second line that starts with `pip install torch==`: the test command
    ci = [line for line in README.splitlines() if line.startswith("pip install torch==")]
    assert ci[:2] == [demo, tests]


def test_readme_says_what_it_does_how_to_install_and_cpu_torch_before_the_first_command():
    start, _ = _first_code_block()
    before = README[:start]
    first_paragraph = before.split("\n\n")[1]
    assert "faster" in first_paragraph and "bit for bit" in first_paragraph
    for mechanism in ("torch.compile", "ATen", "Triton", "Dynamo"):
        assert mechanism not in first_paragraph, mechanism
    assert "not on the package index" in before and "git clone" in before and "pip install -e ." in before
    assert "--index-url https://download.pytorch.org/whl/cpu" in before
