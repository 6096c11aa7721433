"""End-to-end tests of the CLI (CPU): demo, generate on a tiny offline pipeline, compare, errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import exactdit
from exactdit.cli import main
from exactdit.device.numerics import INTERPRET

REPO = Path(__file__).resolve().parents[2]
FIX = Path(__file__).parents[1] / "fixtures"


@pytest.fixture(scope="module")
def tiny_pipe_dir(tmp_path_factory):
    from exactdit.harness.tiny import save_tiny_pipeline

    return Path(save_tiny_pipeline(tmp_path_factory.mktemp("tiny_ernie") / "pipe", seed=0))


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def assert_clean_error(res, code, *needles):
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output
    for n in needles:
        assert n in res.output, res.output


# ------------------------------------------------------------------------------------------- basics


def test_help_and_version():
    res = invoke("--help")
    assert res.exit_code == 0
    for cmd in ("demo", "generate", "compare", "selfcheck", "tiny-pipeline", "coverage"):
        assert cmd in res.output
    res = invoke("--version")
    assert res.exit_code == 0 and res.output.startswith("exactdit ")


def test_python_dash_m_entry_point():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "exactdit", "--help"], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "generate" in out.stdout


# --------------------------------------------------------------------------------------------- demo


def test_coverage_lists_regions_and_the_fused_share():
    res = invoke("coverage", "--model", "flux", "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert "graph FluxTransformerBlock" in res.output and "left to ATen" in res.output
    share = float(res.output.split("fused")[-1].split("=")[1].split("%")[0])
    assert 50 < share <= 100


def test_demo_samples_flux_through_its_diffusers_pipeline(tmp_path):
    res = invoke("demo", "--model", "flux", "--config", "tiny", "--steps", 2, "--out", tmp_path, "--device", "cpu",
                 "--no-progress", "--dtype", "bf16")
    assert res.exit_code == 0, res.output
    assert "FluxPipeline" in res.output and "EQUAL" in res.output and "DIFFERENT" not in res.output
    assert "graph FluxTransformer2DModel.FluxTransformerBlock" in res.output


def test_demo_with_cuda_graphs_on_the_cpu_runs_unrecorded_and_equal(tmp_path):
    res = invoke("demo", "--config", "tiny", "--steps", 2, "--out", tmp_path, "--device", "cpu", "--no-progress",
                 "--warmup", 0, "--cuda-graphs")
    assert res.exit_code == 0, res.output
    assert "EQUAL" in res.output and "DIFFERENT" not in res.output
    rep = json.loads((tmp_path / "perf_patched.json").read_text())["exactdit_report"]
    graphs = rep["cuda_graphs.ErnieImageTransformer2DModel"]
    assert graphs["fused"] == 0 and list(graphs["eager_reasons"]) == ["a tensor argument not on a CUDA device"]


def test_demo_tiny_end_to_end(tmp_path):
    res = invoke("demo", "--config", "tiny", "--steps", 2, "--seed", 1, "--out", tmp_path, "--device", "cpu",
                 "--no-progress")
    assert res.exit_code == 0, res.output
    out = res.output
    assert "EQUAL" in out and "DIFFERENT" not in out
    assert "fused Triton path needs a CUDA GPU" in out
    assert "fell back to eager" in out
    # the slow phases announce themselves (issue 17, item 4) ...
    assert "building weights:" in out and "built in" in out
    assert "eager: 1 untimed warmup call" in out and "patched: warmup done in" in out
    # ... and the output says what ran: no speedup without a GPU (item 6)
    assert "speedup  " not in out and "no speedup is shown" in out
    if INTERPRET:
        assert "Triton's CPU interpreter" in out and "both runs use eager" not in out
    for f in ("demo_latents.png", "perf_eager.json", "perf_patched.json"):
        assert (tmp_path / f).is_file(), f
    eager = json.loads((tmp_path / "perf_eager.json").read_text())
    patched = json.loads((tmp_path / "perf_patched.json").read_text())
    assert eager["outputs"]["latents_md5"] == patched["outputs"]["latents_md5"]
    assert eager["outputs"]["latents_md5"] in out
    assert len(patched["timings"]["steps_s"]) == 2
    assert patched["args"]["config"] == "tiny" and patched["args"]["dtype"] == "fp32"
    assert patched["args"]["model"] == "ernie"
    assert patched["outputs"]["verdict"] == "EQUAL"
    rep = patched["exactdit_report"]
    assert rep and all({"fused", "eager", "eager_reasons"} <= set(e) for e in rep.values())
    fused, eager = sum(e["fused"] for e in rep.values()), sum(e["eager"] for e in rep.values())
    assert fused + eager > 0
    if not INTERPRET:  # CPU without Triton's interpreter: nothing can run fused
        assert fused == 0
    # the two perf JSONs feed `compare`
    res = invoke("compare", tmp_path / "perf_eager.json", tmp_path / "perf_patched.json")
    assert res.exit_code == 0 and res.output.startswith("| metric |")


def test_demo_exits_nonzero_when_runs_differ(monkeypatch, tmp_path):
    saved = {}
    real_patch, real_unpatch = exactdit.patch, exactdit.unpatch

    def bad_patch(obj, **options):  # the real patch, then a change of numerics it must not make
        summary = real_patch(obj, **options)
        w = obj.transformer.final_linear.weight
        saved["w"] = w.detach().clone()
        with torch.no_grad():
            w.mul_(1.0 + 2.0**-8)
        return summary

    def bad_unpatch(obj):
        with torch.no_grad():
            obj.transformer.final_linear.weight.copy_(saved["w"])
        return real_unpatch(obj)

    monkeypatch.setattr(exactdit, "patch", bad_patch)
    monkeypatch.setattr(exactdit, "unpatch", bad_unpatch)
    res = invoke("demo", "--config", "tiny", "--steps", 2, "--out", tmp_path, "--device", "cpu", "--no-progress",
                 "--warmup", 0)
    assert res.exit_code == 1, res.output
    assert "DIFFERENT" in res.output
    assert json.loads((tmp_path / "perf_patched.json").read_text())["outputs"]["verdict"] == "DIFFERENT"


def test_demo_without_the_interpreter_says_everything_ran_eager(monkeypatch, tmp_path):
    from exactdit import gate

    monkeypatch.setattr(gate, "INTERPRET", False)  # CPU as a user has it: no fused kernel can run
    res = invoke("demo", "--config", "diffusers_test", "--steps", 1, "--out", tmp_path, "--device", "cpu",
                 "--no-progress", "--warmup", 0)
    assert res.exit_code == 0, res.output
    assert "the patched run falls back to eager PyTorch op by op" in res.output
    assert "no speedup is shown: both runs used eager PyTorch" in res.output
    assert "interpreter" not in res.output and "untimed warmup" not in res.output


def test_demo_warns_that_a_huge_config_is_impractical_on_cpu(monkeypatch, tmp_path):
    from exactdit.harness import demo as demo_mod

    def stop(*args, **kwargs):
        raise demo_mod.HarnessError("stopped before building")

    monkeypatch.setattr(demo_mod, "available_bytes", lambda device: 1 << 50)  # passes the memory check
    monkeypatch.setattr(demo_mod, "build_pipeline", stop)
    res = invoke("demo", "--config", "full", "--dtype", "bf16", "--device", "cpu", "--out", tmp_path)
    assert_clean_error(res, 1, "is impractical on CPU", "building weights: 15.0 GiB in bf16",
                       "Error: stopped before building")
    assert res.output.index("impractical") < res.output.index("building weights")
    res = invoke("demo", "--config", "small", "--device", "cpu", "--out", tmp_path)
    assert_clean_error(res, 1, "building weights")
    assert "impractical" not in res.output


def test_demo_without_patch_api_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delattr(exactdit, "patch", raising=False)
    res = invoke("demo", "--config", "tiny", "--steps", 1, "--out", tmp_path)
    assert_clean_error(res, 1, "Error:", "exactdit.patch()")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["demo", "--config", "huge"], "--config"),
        (["demo", "--steps", "0"], "--steps"),
        (["demo", "--dtype", "fp64"], "--dtype"),
        (["demo", "--device", "tpu"], "--device"),
        (["generate", "--prompt", "x"], "--model-path"),
        (["generate", "--model-path", "."], "--prompt"),
        (["compare"], "FILES"),
        (["demo", "--seed", "99999999999999999999999"], "--seed"),
        (["demo", "--seed", "-1"], "--seed"),
        (["generate", "--model-path", ".", "--prompt", "x", "--seed", str(2**64)], "--seed"),
        (["tiny-pipeline", "out", "--seed", str(2**64)], "--seed"),
    ],
)
def test_bad_arguments_exit_2(args, needle):
    res = invoke(*args)
    assert_clean_error(res, 2, needle)


def test_demo_cuda_requested_without_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    res = invoke("demo", "--device", "cuda", "--out", tmp_path)
    assert_clean_error(res, 1, "Error:", "no CUDA GPU")


# ----------------------------------------------------------------------------------------- generate


def test_generate_ab_end_to_end(tiny_pipe_dir, tmp_path):
    res = invoke("generate", "--model-path", tiny_pipe_dir, "--prompt", "a red cat on the tree", "--ab",
                 "--steps", 2, "--height", 32, "--width", 32, "--seed", 7, "--out", tmp_path, "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert "A/B: EQUAL" in res.output
    assert "eager deterministic across repeats: yes" in res.output
    for f in ("image_patched_0.png", "image_baseline_0.png", "perf_patched.json", "perf_baseline.json",
              "ab_report.json", "ab_report.md", "ab_side_by_side_0.png", "ab_latents_side_by_side.png"):
        assert (tmp_path / f).is_file(), f
    rep = json.loads((tmp_path / "ab_report.json").read_text())
    pvb = rep["patched_vs_baseline"]
    assert rep["verdict"] == "EQUAL" and rep["baseline_deterministic"] is True
    assert pvb["latents"]["md5_a"] == pvb["latents"]["md5_b"]
    assert pvb["images"][0]["psnr_db"] == "inf" and pvb["images"][0]["ssim"] == 1.0
    perf = json.loads((tmp_path / "perf_patched.json").read_text())
    st = perf["timings"]["stages"]
    assert all(isinstance(st[k], float) and st[k] > 0 for k in ("text_encoding_s", "denoising_s", "decoding_s"))
    assert len(perf["timings"]["steps_s"]) == 2
    assert perf["timings"]["total_s"] >= st["text_encoding_s"] + st["denoising_s"]
    assert perf["args"]["use_pe"] is False and perf["args"]["seed"] == 7
    from PIL import Image

    assert Image.open(tmp_path / "image_patched_0.png").size == (32, 32)


def test_generate_without_ab_is_reproducible(tiny_pipe_dir, tmp_path):
    md5s = []
    for sub in ("a", "b"):
        res = invoke("generate", "--model-path", tiny_pipe_dir, "--prompt", "blue sky", "--steps", 1,
                     "--height", 32, "--width", 32, "--guidance-scale", 1.0, "--out", tmp_path / sub)
        assert res.exit_code == 0, res.output
        assert not (tmp_path / sub / "ab_report.json").exists()
        md5s.append(json.loads((tmp_path / sub / "perf_patched.json").read_text())["outputs"]["image_md5"])
    assert md5s[0] == md5s[1]


def test_generate_missing_folder(tmp_path):
    res = invoke("generate", "--model-path", tmp_path / "nope", "--prompt", "x")
    assert_clean_error(res, 1, "Error: model folder not found")


def test_generate_not_a_pipeline_folder(tmp_path):
    res = invoke("generate", "--model-path", tmp_path, "--prompt", "x")
    assert_clean_error(res, 1, "no model_index.json")


def test_generate_incomplete_folder(tiny_pipe_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_pipe_dir, broken)
    for f in (broken / "transformer").glob("*.safetensors"):
        f.unlink()
    (broken / "scheduler" / "scheduler_config.json").unlink()
    res = invoke("generate", "--model-path", broken, "--prompt", "x")
    assert_clean_error(res, 1, "incomplete model folder", "transformer weights", "scheduler/scheduler_config.json")
    shutil.rmtree(broken / "vae")
    res = invoke("generate", "--model-path", broken, "--prompt", "x")
    assert_clean_error(res, 1, "vae/")


def test_generate_bad_size_is_refused_before_loading(tiny_pipe_dir, tmp_path, monkeypatch):
    from exactdit.harness import generate as gen_mod

    def no_load(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the size was checked")

    monkeypatch.setattr(gen_mod, "load_pipeline", no_load)
    res = invoke("generate", "--model-path", tiny_pipe_dir, "--prompt", "x", "--height", 30, "--width", 32,
                 "--steps", 1, "--out", tmp_path)
    assert_clean_error(res, 1, "Error: --height and --width must be multiples of 4 for this model (got 30x32)")


def test_generate_use_pe_note_comes_before_loading(tiny_pipe_dir, tmp_path, monkeypatch):
    from exactdit.harness import generate as gen_mod

    def stop(*args, **kwargs):
        raise gen_mod.ModelDirError("stopped before loading")

    monkeypatch.setattr(gen_mod, "load_pipeline", stop)
    res = invoke("generate", "--model-path", tiny_pipe_dir, "--prompt", "x", "--use-pe", "--height", 32,
                 "--width", 32, "--out", tmp_path)
    assert_clean_error(res, 1, "no prompt-enhancer (pe) component", "Error: stopped before loading")


@pytest.mark.parametrize("content, needle", [
    (b"\xff\xfe\x00binary", "model_index.json is not valid JSON (not UTF-8 text)"),
    (b"[1]", "model_index.json must hold a JSON object, not a list"),
    (b"{not json", "model_index.json is not valid JSON"),
    (b'{"_class_name": "FluxPipeline"}', "holds a FluxPipeline pipeline; expected ErnieImagePipeline"),
    (b"{}", "model_index.json names no pipeline class (_class_name); expected ErnieImagePipeline"),
])
def test_generate_bad_model_index(tmp_path, content, needle):
    (tmp_path / "model_index.json").write_bytes(content)
    res = invoke("generate", "--model-path", tmp_path, "--prompt", "x")
    assert_clean_error(res, 1, "Error: ", needle)
    assert "a unknown" not in res.output


def test_generate_bad_vae_config_is_a_clear_error(tiny_pipe_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_pipe_dir, broken)
    (broken / "vae" / "config.json").write_text("[]")
    res = invoke("generate", "--model-path", broken, "--prompt", "x", "--out", tmp_path / "o")
    assert_clean_error(res, 1, "vae/config.json must hold a JSON object, not a list")


def test_generate_corrupt_weights(tiny_pipe_dir, tmp_path):
    import shutil

    broken = tmp_path / "corrupt"
    shutil.copytree(tiny_pipe_dir, broken)
    for f in (broken / "transformer").glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    res = invoke("generate", "--model-path", broken, "--prompt", "x", "--steps", 1, "--out", tmp_path / "o")
    assert_clean_error(res, 1, "could not load the pipeline")


# ------------------------------------------------------------------------------------------ compare


def test_tiny_pipeline_command_then_generate(tmp_path):
    res = invoke("tiny-pipeline", tmp_path / "p")
    assert res.exit_code == 0, res.output
    res = invoke("generate", "--model-path", tmp_path / "p", "--prompt", "a", "--steps", 1, "--height", 16,
                 "--width", 16, "--out", tmp_path / "o")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "o" / "image_patched_0.png").is_file()


def test_compare_cli_on_fixtures():
    res = invoke("compare", FIX / "perf_base.json", FIX / "perf_new.json")
    assert res.exit_code == 0
    assert "| end-to-end (s) | 10.0000 | 8.0000 (-20.0%, 1.25x) |" in res.output
    assert "| decoding (s) | 1.0000 | 0.6000 (-40.0%, 1.67x) |" in res.output


def test_compare_cli_errors(tmp_path):
    res = invoke("compare", FIX / "perf_base.json")
    assert_clean_error(res, 1, "at least two")
    res = invoke("compare", FIX / "perf_base.json", tmp_path / "missing.json")
    assert_clean_error(res, 1, "no such file")
    png = tmp_path / "image.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    res = invoke("compare", FIX / "perf_base.json", png)
    assert_clean_error(res, 1, "image.png: not a JSON file (not UTF-8 text)")
    bad_stages = tmp_path / "stages.json"
    bad_stages.write_text(json.dumps({"timings": {"total_s": 1.0, "stages": 3}}))
    res = invoke("compare", FIX / "perf_base.json", bad_stages)
    assert_clean_error(res, 1, "stages.json: not an exactdit perf JSON (timings.stages must be an object, got 3)")
    assert len(res.output.strip().splitlines()) == 1


def test_demo_refuses_config_that_does_not_fit(monkeypatch, tmp_path):
    from exactdit.harness import demo as demo_mod

    monkeypatch.setattr(demo_mod, "available_bytes", lambda device: 1 << 20)
    res = invoke("demo", "--config", "small", "--device", "cpu", "--out", tmp_path)
    assert_clean_error(res, 1, "--config small needs about", "GiB")


def test_selfcheck_holds_patched_models_to_eager():
    result = invoke("selfcheck")
    assert result.exit_code == 0, result.output
    assert "all results bit-identical to eager" in result.output
    for name in ("flux", "ernie"):
        assert f"{name}: patched forward equal to eager" in result.output
    assert "fused" in result.output and "eager because" in result.output


def test_selfcheck_says_what_ran_without_a_gpu(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    from exactdit import gate
    from exactdit.harness import selfcheck

    monkeypatch.setattr(gate, "INTERPRET", False)
    lines = []
    assert selfcheck.main(("flux",), echo=lines.append) == 0
    assert any("every region takes its eager fallback" in line for line in lines)


def test_selfcheck_exits_non_zero_when_a_model_differs(monkeypatch):
    from exactdit.harness import selfcheck

    real = selfcheck._forward
    calls = []

    def wrong(models, name, tr, kw):  # the patched forwards (every call after the first) differ
        calls.append(name)
        out = real(models, name, tr, kw)
        return out if len(calls) == 1 else out + 1

    monkeypatch.setattr(selfcheck, "_forward", wrong)
    lines = []
    assert selfcheck.main(("flux",), echo=lines.append) == 1
    assert any(line.startswith("FAIL flux") for line in lines)
