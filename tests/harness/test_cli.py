"""End-to-end tests of the CLI (CPU): demo, generate on a tiny offline pipeline, compare, errors."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import exactdit
from exactdit.cli import MODEL_CHOICES, main
from exactdit.device.numerics import INTERPRET

REPO = Path(__file__).resolve().parents[2]
FIX = Path(__file__).parents[1] / "fixtures"


@pytest.fixture(scope="module")
def tiny_pipe_dir(tmp_path_factory):
    from exactdit.harness.tiny import write_tiny_pipeline

    return Path(write_tiny_pipeline(tmp_path_factory.mktemp("tiny_ernie") / "pipe", seed=0))


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
    intro, commands = res.output.split("Commands:")
    assert "ERNIE-Image: demo, generate and compare" not in intro
    for cmd in ("demo", "generate", "compare", "selfcheck", "tiny-pipeline", "coverage"):
        assert f"{cmd}`" in intro, cmd  # the description says what each command is for
        assert f"\n  {cmd} " in commands, cmd
    assert "..." not in commands  # no one-line help cut short
    res = invoke("--version")
    assert res.exit_code == 0 and res.output.startswith("exactdit ")


def test_the_cli_drops_third_party_advice_and_nothing_else():
    """diffusers' accelerate advice, transformers' torchvision fallback note and diffusers' FluxPosEmbed
    FutureWarning are dropped (issue 35, item 12); other messages of the same loggers still show."""
    import logging
    import warnings

    assert invoke("version").exit_code == 0  # every command installs the filters
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    cases = {
        "diffusers.pipelines.pipeline_utils": "Cannot initialize model with low cpu memory usage because "
                                              "`accelerate` was not found in the environment. Defaulting to ...",
        "diffusers.models.modeling_utils": "Cannot initialize model with low cpu memory usage because "
                                           "`accelerate` was not found in the environment. Defaulting to ...",
        "transformers.utils.import_utils": "`CLIPImageProcessor` requires torchvision (not installed); falling "
                                           "back to `CLIPImageProcessorPil` for backward compatibility.",
        "torch.utils._pytree": "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
                               "torch.compile as an opaque value type.",
    }
    if torch.version.cuda is None:  # torchao's CUDA extensions: only a CPU build cannot load them
        cases["torchao"] = "Failed to load /x/torchao/_C_mxfp8.so: Could not load this library"
    for name, message in cases.items():
        logger, handler = logging.getLogger(name), Keep()
        logger.addHandler(handler)
        try:
            logger.warning(message)
            logger.warning("some other warning")
        finally:
            logger.removeHandler(handler)
    assert seen == ["some other warning"] * len(cases)
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("`FluxPosEmbed` is deprecated and will be removed in version 1.0.0.", FutureWarning)
        warnings.warn("`Other` is deprecated", FutureWarning)
    assert [str(w.message) for w in caught] == ["`Other` is deprecated"]


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


def test_coverage_says_what_it_measures(monkeypatch):
    from exactdit.engine import timing

    monkeypatch.setattr(timing, "measure", lambda tr, kw, blocks: [])
    res = invoke("coverage", "--model", "wan", "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert res.output.startswith("exactdit coverage: wan config=tiny (")
    assert "bf16, 64x64x5 frames, batch 1, cpu (" in res.output.splitlines()[0]


@pytest.mark.parametrize("args, needle", [
    (["--model", "flux", "--frames", "5"], "Invalid value for '--frames': flux is an image model"),
    (["--model", "wan", "--frames", "6"], "Invalid value for '--frames': wan takes 4k+1 frames"),
    (["--model", "flux", "--height", "30"], "Invalid value for '--height': flux needs a multiple of 16, got 30"),
])
def test_coverage_bad_geometry_names_the_option(args, needle):
    res = invoke("coverage", "--device", "cpu", *args)
    assert_clean_error(res, 2, needle)
    assert "num_frames" not in res.output


def test_coverage_huge_size_is_refused_before_any_allocation(monkeypatch):
    from exactdit.harness import demo as demo_mod
    from exactdit.harness import models

    def no_build(*args, **kwargs):
        raise AssertionError("the transformer was built before the size was checked")

    monkeypatch.setattr(demo_mod, "available_bytes", lambda device: 16 << 30)
    monkeypatch.setattr(models, "build_transformer", no_build)
    res = invoke("coverage", "--model", "flux", "--height", 100000, "--width", 100000, "--device", "cpu")
    assert_clean_error(res, 1, "Error: --height 100000 --width 100000 needs at least", "GiB for its activations",
                       "only 16.0 GiB is free on cpu; use a smaller --height / --width")
    assert res.output.count("Error:") == 1


def test_demo_samples_flux_through_its_diffusers_pipeline(tmp_path):
    res = invoke("demo", "--model", "flux", "--config", "tiny", "--steps", 2, "--out", tmp_path, "--device", "cpu",
                 "--no-progress", "--dtype", "bf16")
    assert res.exit_code == 0, res.output
    assert "FluxPipeline" in res.output and "EQUAL" in res.output and "DIFFERENT" not in res.output
    assert "graph FluxTransformer2DModel.FluxTransformerBlock" in res.output


def test_demo_lists_exactly_the_registered_models():
    from exactdit.harness import models

    assert MODEL_CHOICES == models.model_names()
    res = invoke("demo", "--help")
    for name in MODEL_CHOICES:
        assert name in res.output


@pytest.mark.parametrize("model", MODEL_CHOICES)
def test_demo_runs_every_listed_model_equal(model, tmp_path):
    """Every model `demo --help` lists runs through its diffusers pipeline to EQUAL (issue 35, item 1:
    Wan pipelines return .frames, not .images). One tiny step each: 5-20 s on 2 CPU cores."""
    out = tmp_path / "demo"
    res = invoke("demo", "--model", model, "--config", "tiny", "--steps", 1, "--out", out, "--device", "cpu",
                 "--no-progress", "--warmup", 0)
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output
    assert "result    EQUAL" in res.output and "DIFFERENT" not in res.output
    for f in ("demo_latents.png", "perf_eager.json", "perf_patched.json"):
        assert (out / f).is_file(), f
    assert json.loads((out / "perf_patched.json").read_text())["outputs"]["verdict"] == "EQUAL"
    # the regions are called a plan, not "fused" (on the CPU 0 calls ran fused), and every reason an
    # op was left to ATen names that op (issue 35, item 13)
    assert "plan      the regions the engine made" in res.output and "  region x" in res.output
    assert "fused x" not in res.output
    left_ops = []
    for line in res.output.splitlines():
        if line.strip().startswith("left to ATen:"):
            left_ops = [op.strip().rsplit(" x", 1)[0] for op in line.split(":", 1)[1].split(", ")]
        elif re.match(r"^\s+x\d+: ", line):
            reason = line.split(": ", 1)[1]
            assert any(reason.startswith(op) for op in left_ops), (line, left_ops)


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
        (["demo", "--guidance-scale", "-1"], "--guidance-scale"),
        (["demo", "--guidance-scale", "nan"], "Invalid value for '--guidance-scale': 'nan' is not a finite number"),
        (["demo", "--guidance-scale", "inf"], "Invalid value for '--guidance-scale': 'inf' is not a finite number"),
        (["generate", "--model-path", ".", "--prompt", "x", "--guidance-scale", "nan"], "'nan' is not a finite"),
        (["generate", "--model-path", ".", "--prompt", "x", "--guidance-scale", "inf"], "'inf' is not a finite"),
        (["generate", "--model-path", ".", "--prompt", "x", "--guidance-scale", "-inf"], "--guidance-scale"),
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
    # CPU timings without a warm-up compare nothing, and the output says so (issue 35, item 6)
    assert "NOTE: no CUDA GPU, so the timings are no speed measurement" in res.output
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


def test_generate_timing_notes():
    from exactdit.harness.generate import timing_notes

    runs = {"baseline": {}, "baseline_repeat": {}, "patched": {}}
    assert timing_notes(torch.device("cuda"), True, runs) == []
    (note,) = timing_notes(torch.device("cuda"), False, runs)
    assert note.startswith("NOTE: --no-warmup: each run's time includes one-time costs")
    assert timing_notes(torch.device("cuda"), False, {"patched": {}}) == []
    (note,) = timing_notes(torch.device("cpu"), True, {"patched": {}})
    assert "no speed measurement" in note


def test_generate_no_progress_turns_the_bars_off(tiny_pipe_dir, tmp_path, monkeypatch):
    from exactdit.harness import generate as gen_mod

    seen = []

    def stop(pipe, opts, *args, **kwargs):
        seen.append(opts.progress)
        raise gen_mod.HarnessError("stopped")

    monkeypatch.setattr(gen_mod, "timed_run", stop)
    for flag in ("--no-progress", "--progress"):
        res = invoke("generate", "--model-path", tiny_pipe_dir, "--prompt", "x", "--height", 16, "--width", 16,
                     "--out", tmp_path / "o", "--device", "cpu", flag)
        assert_clean_error(res, 1, "Error: stopped")
    assert seen == [False, True]


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


def test_generate_huge_size_is_refused_before_loading(tiny_pipe_dir, tmp_path, monkeypatch):
    from exactdit.harness import demo as demo_mod
    from exactdit.harness import generate as gen_mod

    def no_load(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the size was checked")

    monkeypatch.setattr(gen_mod, "load_pipeline", no_load)
    monkeypatch.setattr(demo_mod, "available_bytes", lambda device: 16 << 30)
    out = tmp_path / "o"
    res = invoke("generate", "--model-path", tiny_pipe_dir, "--prompt", "cat", "--height", 100000, "--width",
                 100000, "--steps", 1, "--out", out, "--device", "cpu")
    # 1e10 pixels x 8 VAE channels x 4 bytes, input and output of the decoder's last block
    assert_clean_error(res, 1, "Error: --height 100000 --width 100000 needs at least 596.0 GiB",
                       "only 16.0 GiB is free on cpu")
    assert not out.exists()


def test_generate_out_of_memory_is_one_line(tiny_pipe_dir, tmp_path, monkeypatch):
    from exactdit.harness import generate as gen_mod

    def oom(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 40000000000 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(gen_mod, "timed_run", oom)
    out = tmp_path / "o"
    res = invoke("generate", "--model-path", tiny_pipe_dir, "--prompt", "cat", "--height", 32, "--width", 32,
                 "--steps", 1, "--out", out, "--device", "cpu")
    assert_clean_error(res, 1, "Error: out of memory at --height 32 --width 32: use a smaller size")
    assert not out.exists()


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
    assert not (tmp_path / "o").exists()  # a failed run leaves no empty output folder


# ------------------------------------------------------------------------------------------ compare


def test_tiny_pipeline_command_then_generate(tmp_path):
    import shlex

    res = invoke("tiny-pipeline", tmp_path / "p")
    assert res.exit_code == 0, res.output
    # the printed command runs as it is (a size that fits the tiny VAE, not generate's 1024 default)
    cmd = shlex.split(res.output.split("next")[1].strip())
    assert cmd[:2] == ["exactdit", "generate"] and cmd[cmd.index("--height") + 1] == "32"
    res = invoke(*cmd[1:], "--steps", 1, "--out", tmp_path / "o")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "o" / "image_patched_0.png").is_file()


def test_tiny_pipeline_refuses_a_non_empty_folder_without_force(tmp_path):
    target = tmp_path / "p"
    target.mkdir()
    (target / "mine.txt").write_text("keep")
    res = invoke("tiny-pipeline", target)
    assert_clean_error(res, 1, f"Error: DIR {target} is not empty; pass --force")
    assert sorted(p.name for p in target.iterdir()) == ["mine.txt"]
    assert invoke("tiny-pipeline", target, "--force").exit_code == 0
    first = (target / "transformer" / "config.json").read_text()
    (target / "transformer" / "stale.bin").write_bytes(b"old")
    res = invoke("tiny-pipeline", target, "--force", "--seed", 1)
    assert res.exit_code == 0, res.output
    # the pipeline is replaced whole (no stale file inside it), the user's file is kept
    assert not (target / "transformer" / "stale.bin").exists() and (target / "mine.txt").read_text() == "keep"
    assert (target / "transformer" / "config.json").read_text() == first
    assert (target / "model_index.json").is_file()


@pytest.mark.parametrize("key", ["..", "", "absolute"])
def test_tiny_pipeline_force_removes_nothing_outside_dir(tmp_path, key):
    """The components of the pipeline already in DIR come from its model_index.json: a key that is
    not a plain name (``..``, empty, absolute) names nothing to remove. (Every key here names
    something inside ``tmp_path``: a broken build must not be able to remove more than that.)"""
    import json

    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "file.txt").write_text("keep")
    target = tmp_path / "pipe"
    target.mkdir()
    (target / "mine.txt").write_text("keep")
    key = str(tmp_path / "keep") if key == "absolute" else key
    (target / "model_index.json").write_text(json.dumps({key: ["diffusers", "X"]}))
    assert invoke("tiny-pipeline", target, "--force").exit_code == 0
    assert (tmp_path / "keep" / "file.txt").read_text() == "keep" and (target / "mine.txt").read_text() == "keep"
    assert (target / "model_index.json").is_file() and (target / "transformer").is_dir()


def test_an_interrupted_commit_leaves_the_earlier_results_whole(tmp_path, monkeypatch):
    """Ctrl-C (or a full disk) while the new files are moved in: the earlier run's files are back,
    none of the new ones is left, and an output folder the commit created is removed."""
    import os
    import pathlib

    from exactdit.harness import outputs

    out = tmp_path / "out"
    out.mkdir()
    for name in ("a.png", "b.json"):
        (out / name).write_text("old " + name)
    (out / "user.txt").write_text("mine")
    real_rename = os.rename

    def interrupted(src, dst, *args, **kwargs):  # the second new file's move into place
        if ".exactdit-new-" in str(src) and pathlib.Path(dst).name == "b.json":
            raise KeyboardInterrupt
        return real_rename(src, dst, *args, **kwargs)

    for target in (out, tmp_path / "fresh"):
        with outputs.StagedOutput(target, ["*.png", "*.json"]) as staged:
            for name in ("a.png", "b.json"):
                staged.path(name).write_text("new " + name)
            monkeypatch.setattr(os, "rename", interrupted)
            with pytest.raises(KeyboardInterrupt):
                staged.commit()
            monkeypatch.setattr(os, "rename", real_rename)
    assert {p.name: p.read_text() for p in out.iterdir()} == {"a.png": "old a.png", "b.json": "old b.json",
                                                              "user.txt": "mine"}
    assert not (tmp_path / "fresh").exists()


def test_tiny_pipeline_into_an_unwritable_place_names_dir():
    res = invoke("tiny-pipeline", "/proc/exactdit-x")
    assert_clean_error(res, 1, "Error: DIR /proc/exactdit-x: cannot write there")


@pytest.mark.parametrize("command", ["demo", "generate"])
def test_unwritable_out_names_the_option_before_running(command, tiny_pipe_dir, tmp_path, monkeypatch):
    from exactdit.harness import demo as demo_mod
    from exactdit.harness import generate as gen_mod

    def no_run(*args, **kwargs):
        raise AssertionError("ran before --out was checked")

    monkeypatch.setattr(demo_mod, "build_pipeline", no_run)
    monkeypatch.setattr(gen_mod, "load_pipeline", no_run)
    args = ["demo", "--steps", 1] if command == "demo" else ["generate", "--model-path", tiny_pipe_dir,
                                                              "--prompt", "x", "--height", 16, "--width", 16]
    res = invoke(*args, "--device", "cpu", "--out", "/proc/exactdit-x")
    assert_clean_error(res, 1, "Error: --out /proc/exactdit-x: cannot write there (No such file or directory)")
    a_file = tmp_path / "file"
    a_file.write_text("")
    res = invoke(*args, "--device", "cpu", "--out", a_file / "sub")
    assert_clean_error(res, 1, f"Error: --out {a_file / 'sub'}: {a_file} is a file, not a folder")


def test_generate_replaces_the_files_of_an_earlier_run(tiny_pipe_dir, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    for stale in ("ab_report.md", "ab_report.json", "perf_baseline.json", "image_baseline_0.png"):
        (out / stale).write_text("an earlier --ab run")
    (out / "notes.txt").write_text("mine")
    res = invoke("generate", "--model-path", tiny_pipe_dir, "--prompt", "a", "--steps", 1, "--height", 16,
                 "--width", 16, "--out", out, "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == ["image_patched_0.png", "notes.txt", "perf_patched.json"]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("command", ["demo", "generate"])
def test_a_failed_or_interrupted_run_leaves_no_output(command, interrupt, tiny_pipe_dir, tmp_path, monkeypatch):
    import tempfile

    from exactdit.harness import demo as demo_mod
    from exactdit.harness import generate as gen_mod

    def fail(*args, **kwargs):
        raise interrupt("stopped mid-run")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(demo_mod, "sample_pipeline", fail)
    monkeypatch.setattr(gen_mod, "timed_run", fail)
    out = tmp_path / "runs" / "o"
    args = ["demo", "--steps", 1, "--warmup", 0, "--no-progress"] if command == "demo" else [
        "generate", "--model-path", tiny_pipe_dir, "--prompt", "x", "--height", 16, "--width", 16]
    res = CliRunner().invoke(main, [str(a) for a in args] + ["--device", "cpu", "--out", str(out)])
    assert res.exit_code != 0
    assert not (tmp_path / "runs").exists()
    assert list((tmp_path / "tmp").iterdir()) == []  # the staging folder is gone too
    # an earlier run's files stay as they were
    out.mkdir(parents=True)
    (out / "perf_patched.json").write_text("earlier")
    res = CliRunner().invoke(main, [str(a) for a in args] + ["--device", "cpu", "--out", str(out)])
    assert res.exit_code != 0
    assert [p.name for p in out.iterdir()] == ["perf_patched.json"]
    assert (out / "perf_patched.json").read_text() == "earlier"


def test_compare_cli_on_fixtures():
    res = invoke("compare", FIX / "perf_base.json", FIX / "perf_new.json")
    assert res.exit_code == 0
    assert "| end-to-end (s) | 10.0000 | 8.0000 (-20.0%, 1.25x) |" in res.output
    assert "| decoding (s) | 1.0000 | 0.6000 (-40.0%, 1.67x) |" in res.output


def test_compare_cli_refuses_different_runs_without_force():
    files = [FIX / "perf_base.json", FIX / "perf_demo_cpu.json"]
    res = invoke("compare", *files)
    assert_clean_error(res, 1, "Error: the runs differ in run (perf_base.json: generate, perf_demo_cpu.json: demo)",
                       "pass --force to compare them anyway")
    assert "| end-to-end" not in res.output
    res = invoke("compare", *files, "--force")
    assert res.exit_code == 0, res.output
    assert "| end-to-end (s) | 10.0000 | 20.0000 (+100.0%, 0.50x) |" in res.output
    assert "note: the runs differ in device (perf_base.json: cuda (NVIDIA H200), perf_demo_cpu.json: cpu (x86_64))" \
        in res.output


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


def test_guidance_scale_reaches_every_models_pipeline():
    """Qwen-Image's pipeline takes true CFG's scale (the option was dropped for it); a call with
    no guidance at all refuses the option."""
    from exactdit.harness import models
    from exactdit.harness.demo import HarnessError, set_guidance

    for name in ("qwen", "flux", "ernie"):
        call = models.pipeline_call_kwargs(name, height=32, width=32, steps=1)
        set_guidance(call, 7.0, name)
        assert call.get("true_cfg_scale", call.get("guidance_scale")) == 7.0, (name, call)
    with pytest.raises(HarnessError, match="takes no guidance scale"):
        set_guidance({"prompt": "x"}, 7.0, "x")


def test_an_empty_out_is_refused():
    res = invoke("tiny-pipeline", "")
    assert_clean_error(res, 1, "Error: DIR is empty; name a folder")
    res = invoke("demo", "--steps", 1, "--device", "cpu", "--out", "")
    assert_clean_error(res, 1, "Error: --out is empty; name a folder")
