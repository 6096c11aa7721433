import json
from pathlib import Path

import pytest

from exactdit.harness import perf

FIX = Path(__file__).parents[1] / "fixtures"

EXPECTED_TWO = """\
| metric | perf_base.json (eager) | perf_new.json (patched) |
|---|---|---|
| end-to-end (s) | 10.0000 | 8.0000 (-20.0%, 1.25x) |
| text encoding (s) | 1.0000 | 1.0000 (+0.0%, 1.00x) |
| denoising (s) | 8.0000 | 6.4000 (-20.0%, 1.25x) |
| decoding (s) | 1.0000 | 0.6000 (-40.0%, 1.67x) |
| per step, mean (s) | 2.0000 | 1.6000 (-20.0%, 1.25x) |
| per step, median (s) | 1.5000 | 1.2000 (-20.0%, 1.25x) |
| peak GPU memory (MiB) | 2048.0 | 1024.0 (-50.0%, 2.00x) |
"""


def test_compare_two_fixtures_exact_table():
    assert perf.compare([FIX / "perf_base.json", FIX / "perf_new.json"]) == EXPECTED_TWO


def test_compare_three_files_skips_missing_values_and_flags_devices():
    files = [FIX / "perf_base.json", FIX / "perf_new.json", FIX / "perf_demo_cpu.json"]
    with pytest.raises(perf.PerfFileError, match=r"^the runs differ in run \(.*demo\); device \(.*pass --force"):
        perf.compare(files)
    out = perf.compare(files, force=True)
    lines = out.splitlines()
    assert lines[0] == "| metric | perf_base.json (eager) | perf_new.json (patched) | perf_demo_cpu.json (patched) |"
    assert "| end-to-end (s) | 10.0000 | 8.0000 (-20.0%, 1.25x) | 20.0000 (+100.0%, 0.50x) |" in lines
    assert "| text encoding (s) | 1.0000 | 1.0000 (+0.0%, 1.00x) | – |" in lines
    assert ("note: the runs differ in device (perf_base.json: cuda (NVIDIA H200), perf_new.json: cuda (NVIDIA H200), "
            "perf_demo_cpu.json: cpu (x86_64))") in lines
    assert ("note: the runs differ in run (perf_base.json: generate, perf_new.json: generate, "
            "perf_demo_cpu.json: demo)") in lines


def _demo_record(tmp_path, folder, **args):
    rec = json.loads((FIX / "perf_demo_cpu.json").read_text())
    rec["args"] = {"model": "ernie", "config": "tiny", "height": 64, "width": 64, "steps": 8, "dtype": "fp32",
                   "device": "cpu", **args}
    path = tmp_path / folder / "perf_patched.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(rec))
    return path


def test_compare_same_file_names_get_distinct_columns(tmp_path):
    a, b = _demo_record(tmp_path, "demo-a"), _demo_record(tmp_path, "demo-b")
    header = perf.compare([a, b]).splitlines()[0]
    assert header == "| metric | demo-a/perf_patched.json (patched) | demo-b/perf_patched.json (patched) |"
    c, d = _demo_record(tmp_path, "x/runs"), _demo_record(tmp_path, "y/runs")
    assert perf.column_names([c, d]) == ["x/runs/perf_patched.json", "y/runs/perf_patched.json"]
    assert perf.column_names([a, a]) == [f"{a} [1]", f"{a} [2]"]


@pytest.mark.parametrize("change, needle", [
    ({"model": "qwen"}, "model (A: ernie config=tiny, B: qwen config=tiny)"),
    ({"config": "small"}, "model (A: ernie config=tiny, B: ernie config=small)"),
    ({"height": 32}, "size (A: 64x64, B: 32x64)"),
    ({"steps": 2}, "steps (A: 8, B: 2)"),
    ({"dtype": "bf16"}, "dtype (A: fp32, B: bf16)"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else "")
def test_compare_refuses_runs_that_differ_unless_forced(tmp_path, change, needle):
    a, b = _demo_record(tmp_path, "demo-a"), _demo_record(tmp_path, "demo-b", **change)
    needle = needle.replace("A:", "demo-a/perf_patched.json:").replace("B:", "demo-b/perf_patched.json:")
    with pytest.raises(perf.PerfFileError, match="pass --force") as info:
        perf.compare([a, b])
    assert f"the runs differ in {needle}, so their timings are not comparable" in str(info.value)
    assert "\n" not in str(info.value)
    out = perf.compare([a, b], force=True)
    assert f"note: the runs differ in {needle}" in out
    # CPU runs (these records are) get a note that their timings are not exactdit's speed
    assert out.endswith("note: demo-a/perf_patched.json, demo-b/perf_patched.json ran on the CPU, where exactdit's "
                        "fused kernels do not run: no speedup there is exactdit's\n")


def test_compare_errors(tmp_path):
    with pytest.raises(perf.PerfFileError, match="at least two"):
        perf.compare([FIX / "perf_base.json"])
    with pytest.raises(perf.PerfFileError, match="no such file"):
        perf.compare([FIX / "perf_base.json", tmp_path / "nope.json"])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(perf.PerfFileError, match="not a readable JSON"):
        perf.compare([FIX / "perf_base.json", bad])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    with pytest.raises(perf.PerfFileError, match="not an exactdit perf JSON"):
        perf.compare([FIX / "perf_base.json", other])


def test_make_record_round_trips_through_strict_json(tmp_path):
    rec = perf.make_record(
        label="x", kind="demo", device="cpu", total_s=1.5, steps_s=[0.5, 1.0],
        stages={"denoising_s": 1.5}, report={"op": {"fused": 0, "eager": 2, "eager_reasons": {"cpu": 2}}},
        outputs={"psnr": float("inf")},
    )
    p = perf.write_json(tmp_path / "r.json", rec)
    back = json.loads(p.read_text())  # strict: inf was written as a string
    assert back["outputs"]["psnr"] == "inf"
    assert back["timings"] == {"total_s": 1.5, "stages": {"text_encoding_s": None, "denoising_s": 1.5,
                                                          "decoding_s": None}, "steps_s": [0.5, 1.0]}
    assert back["device"]["type"] == "cpu"
    assert set(back["versions"]) >= {"python", "torch", "triton", "diffusers", "transformers", "exactdit"}
    assert back["peak_gpu_memory_bytes"] is None
    assert "git_commit" in back
    assert perf.load_record(p)["label"] == "x"


def _record(**timings):
    return {"schema": perf.SCHEMA, "label": "x", "timings": {"total_s": 1.0, **timings}}


@pytest.mark.parametrize("rec, problem", [
    ({}, "no timings object"),
    ([1], "holds a JSON list, not an object"),
    ({"timings": 3}, "no timings object"),
    (_record(total_s="abc"), 'timings.total_s must be a positive number of seconds, got "abc"'),
    (_record(total_s=None), "timings.total_s must be a positive number of seconds, got null"),
    (_record(total_s=0), "timings.total_s must be a positive number of seconds, got 0"),
    (_record(total_s=-1.5), "got -1.5"),
    (_record(total_s=True), "got true"),
    (_record(total_s=float("nan")), "got NaN"),
    ({"timings": {"total_s": 1.0, "stages": 3}}, "timings.stages must be an object, got 3"),
    (_record(stages={"denoising_s": "fast"}), 'timings.stages.denoising_s must be null or a number of seconds >= 0'),
    (_record(steps_s=[0.1, "x"]), "timings.steps_s must be a list of seconds >= 0"),
    (_record(steps_s=0.1), "timings.steps_s must be a list"),
    ({**_record(), "peak_gpu_memory_bytes": "1GB"}, "peak_gpu_memory_bytes must be null or a number"),
    ({**_record(), "device": "cuda"}, 'device must be an object, got "cuda"'),
    ({**_record(), "label": ["a"]}, "label must be a string"),
    ({**_record(), "schema": "exactdit.perf/9"}, 'schema "exactdit.perf/9", expected exactdit.perf/1'),
], ids=str)
def test_one_schema_check_refuses_every_bad_field(tmp_path, rec, problem):
    """Every malformed value is refused by the one check with the field's name (issue 17, item 2),
    never shown as "–" nor raised as a traceback from inside compare."""
    assert problem in perf.schema_problem(rec)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(rec))
    with pytest.raises(perf.PerfFileError, match=r"bad\.json: not an exactdit perf JSON \(") as info:
        perf.compare([FIX / "perf_base.json", bad])
    assert problem in str(info.value) and "\n" not in str(info.value)


def test_null_and_absent_optional_fields_are_fine(tmp_path):
    minimal = tmp_path / "minimal.json"
    minimal.write_text(json.dumps({"timings": {"total_s": 4.0, "stages": None, "steps_s": None},
                                   "peak_gpu_memory_bytes": None, "device": None}))
    assert perf.schema_problem(json.loads(minimal.read_text())) is None
    out = perf.compare([FIX / "perf_base.json", minimal])
    assert "| end-to-end (s) | 10.0000 | 4.0000 (-60.0%, 2.50x) |" in out
    assert "| decoding (s) | 1.0000 | – |" in out
    for name in ("perf_base.json", "perf_new.json", "perf_demo_cpu.json"):
        assert perf.schema_problem(json.loads((FIX / name).read_text())) is None


def test_binary_file_is_a_clear_error(tmp_path):
    png = tmp_path / "latents.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    with pytest.raises(perf.PerfFileError, match=r"latents\.png: not a JSON file \(not UTF-8 text\)"):
        perf.compare([FIX / "perf_base.json", png])
