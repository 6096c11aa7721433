"""Launch plans' link to Triton: the calling convention is read from the installed Triton, and
anything else keeps launching through ``fn[grid]`` (the plans themselves: tests/engine/test_runtime.py)."""

import pytest
import torch
import triton
import triton.language as tl

from exactdit.device import launch


def test_the_installed_triton_passes_every_bound_argument():
    from triton.runtime.jit import JITFunction

    assert launch.passes_all_bound_arguments(JITFunction.run)


def _older_run(self, *args, grid, warmup, **kwargs):  # the shape of a Triton that drops constexprs
    kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,  # noqa: F821
               hook, hook, *non_constexpr_vals)  # noqa: F821


def test_another_convention_is_not_taken_for_it():
    assert not launch.passes_all_bound_arguments(_older_run)
    assert not launch.passes_all_bound_arguments(len)  # no source


class _Triton36Launcher:
    global_scratch_size = profile_scratch_size = 0

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        def allocate_scratch(size, align, allocator):
            return None

        global_scratch = allocate_scratch(0, 1, None)
        profile_scratch = allocate_scratch(0, 1, None)
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)


class _LauncherWithMore(_Triton36Launcher):
    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)  # noqa: F821
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)  # noqa: F821


def test_the_c_launch_is_called_directly_only_for_a_launcher_that_just_forwards_to_it():
    assert launch._plain_cuda_launcher(_Triton36Launcher())
    assert not launch._plain_cuda_launcher(_LauncherWithMore())
    scratch = _Triton36Launcher()
    scratch.global_scratch_size = 256  # a kernel that needs scratch memory: Triton's own call allocates it
    assert not launch._plain_cuda_launcher(scratch)


@triton.jit
def _kernel(x, y, n, BLOCK: tl.constexpr, SCALE: tl.constexpr = 2):
    pass


def test_bound_arguments_follow_the_declaration_order_with_defaults():
    x, y = torch.zeros(4), torch.zeros(4)
    assert launch.bound_arguments(_kernel, (x, y, 4), {"BLOCK": 16, "num_warps": 4}) == [x, y, 4, 16, 2]
    with pytest.raises(TypeError, match="BLOCK"):
        launch.bound_arguments(_kernel, (x, y, 4), {})


def test_cpu_tensors_are_never_launched_directly():
    assert not launch.supported(torch.device("cpu"))
    assert not launch.hooks_installed()  # Triton's empty hook chains are no hook
