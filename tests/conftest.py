"""Test set-up. Kernels run in Triton's CPU interpreter unless a CUDA GPU is present; the mode
must be chosen before Triton or exactdit is imported."""

import os

import torch

if "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"
# the lowered graphs' disk cache (engine/capture_cache.py) starts empty for each run, so a run's
# first capture of each graph lowers it and the later ones (the same tiny models, test after test)
# load it: both paths run throughout the suite
if "EXACTDIT_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["EXACTDIT_CACHE"] = tempfile.mkdtemp(prefix="exactdit-tests-")
    atexit.register(shutil.rmtree, os.environ["EXACTDIT_CACHE"], ignore_errors=True)

import pytest  # noqa: E402

from exactdit import state  # noqa: E402

ON_GPU = torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] != "1"
#: Where kernel tests run: the GPU when there is one, else CPU tensors through the interpreter.
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


#: tests marked ``slow`` (left out of the default run; ``pytest -m slow`` runs them, .ci/run does):
#: ``path::test_function`` (every parameter): CPU tests that run whole models or many graphs through
#: Triton's interpreter, start processes (gloo ranks, a compiler), or sample pipelines. Each kind
#: keeps a quick representative in the default run (e.g. the engine's small-graph tests, one
#: patched model in test_patch_unpatch_and_report_on_a_model, selfcheck's eager-only test).
SLOW = frozenset(line.strip() for line in """
tests/aten/test_norms.py::test_layer_norm_combine_variants_change_bits
tests/aten/test_reduce.py::test_each_element_counted_once
tests/device/test_compile_for_gpu.py::test_engine_kernels_compile_without_flush_to_zero
tests/device/test_compile_for_gpu.py::test_mini_model_kernels_compile
tests/device/test_numerics.py::test_dtype_ops_equal_eager_ops
tests/patches/test_engine_blocks.py::test_a_block_with_a_graph_break_is_captured_in_parts
tests/patches/test_engine_blocks.py::test_a_block_in_parts_comes_back_to_resolutions_it_ran_and_stays_fused
tests/patches/test_engine_blocks.py::test_caches_on_blocks_run_with_the_blocks_captured
tests/engine/test_captured_models.py::test_captured_blocks_equal_cuda_order
tests/engine/test_templates.py::test_decomposed_rms_norm
tests/patches/test_engine_blocks.py::test_first_block_cache_hooks_run_around_the_captured_blocks
tests/patches/test_engine_blocks.py::test_group_offloading_keeps_working
tests/patches/test_engine_blocks.py::test_hooks_inside_blocks_capture_those_blocks_in_parts_until_removed
tests/engine/test_templates.py::test_layer_norm_per_head_many_rows_per_program
tests/patches/test_engine_blocks.py::test_parts_captured_again_for_inputs_already_run_fall_back_to_eager
tests/engine/test_rules.py::test_pointwise_regions_equal_cpu_eager
tests/patches/test_engine_blocks.py::test_shapes_beyond_dynamos_recompile_limit_run_eager_and_the_captured_ones_stay_fused
tests/harness/test_cli.py::test_demo_exits_nonzero_when_runs_differ
tests/harness/test_cli.py::test_demo_samples_flux_through_its_diffusers_pipeline
tests/harness/test_cli.py::test_demo_tiny_end_to_end
tests/harness/test_cli.py::test_demo_with_cuda_graphs_on_the_cpu_runs_unrecorded_and_equal
tests/harness/test_cli.py::test_generate_ab_end_to_end
tests/harness/test_cli.py::test_generate_without_ab_is_reproducible
tests/harness/test_cli.py::test_selfcheck_holds_patched_models_to_eager
tests/harness/test_cli.py::test_tiny_pipeline_command_then_generate
tests/minis/test_minis.py::test_captured_blocks_equal_cuda_order
tests/minis/test_minis.py::test_patch_captures_every_block
tests/harness/test_models.py::test_full_width_components_run_in_the_pipeline
tests/harness/test_models.py::test_pipeline_samples_offline_and_deterministically
tests/patches/test_context_parallel.py::test_equality_script_runs_under_torchrun
tests/patches/test_context_parallel.py::test_patched_blocks_match_unpatched_under_ring_attention
tests/patches/test_context_parallel.py::test_patched_blocks_match_unpatched_under_ulysses_on_every_rank
tests/patches/test_context_parallel.py::test_uneven_shards_run_diffusers_code_with_the_reason
""".splitlines() if line.strip())


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device)")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip)
        if item.nodeid.split("[")[0] in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """Each test starts with nothing remembered (exactdit.state), default switches, poisoned outputs."""
    for name in ("EXACTDIT_DISABLE", "EXACTDIT_VERIFY_ALL", "EXACTDIT_TRUST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("EXACTDIT_POISON", "1")
    # a region's first call waits for kernels still compiling in worker processes (GPU), so that
    # it verifies them as before; tests of the default (eager meanwhile) unset it
    monkeypatch.setenv("EXACTDIT_WAIT_FOR_KERNELS", "1")
    state.reset()
    yield
    state.reset()
