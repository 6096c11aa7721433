"""Context parallelism: diffusers' own hooks, with plans for transformers diffusers ships none for.

exactdit's engine compiles each repeated block where it sits (``module._compiled_call_impl``), so
diffusers' split/gather hooks and its attention processors' ``_parallel_config`` run unchanged:
Dynamo traces through the hooks and records the collectives, which stay ATen ops in the captured
graph, and each rank captures its own local shapes (a shard's row count picks its own reduction
configuration, exactly as in eager). :func:`enable_context_parallel` is
``model.enable_parallelism`` with a plan from :data:`CP_PLANS` where the class has none.

Launch one process per GPU (``torchrun --nproc-per-node 2 script.py``) and, in each::

    torch.distributed.init_process_group("nccl")
    torch.cuda.set_device(rank)
    exactdit.enable_context_parallel(pipe.transformer, ContextParallelConfig(ulysses_degree=2))
    exactdit.patch(pipe)        # before or after enable_context_parallel
"""

from __future__ import annotations

from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from exactdit.patches import diffusers_internals

# ERNIE-Image runs sequence-first: x, its six per-token modulations and the final projection are
# [S, B, H]; the RoPE angles are [B, S, 1, head_dim]. Every layer receives the same rotary and
# modulation tensors from the transformer's forward, so each layer splits them (a chunk is a view);
# x is split once, at the first layer. The attention mask stays whole: diffusers' Ulysses attention
# sees every key after its all-to-all. Ring attention passes one mask to each key chunk, which
# does not fit ERNIE's full-length mask, so ERNIE runs Ulysses only.
_ERNIE_SEQUENCE = ContextParallelInput(split_dim=0, expected_dims=3, split_output=False)

ERNIE_IMAGE_PLAN = {
    "layers.0": {"x": _ERNIE_SEQUENCE},
    "layers.*": {
        "rotary_pos_emb": ContextParallelInput(split_dim=1, expected_dims=4, split_output=False),
        "temb": [_ERNIE_SEQUENCE] * 6,
    },
    "final_linear": ContextParallelOutput(gather_dim=0, expected_dims=3),
}

#: plans by transformer class name, for classes whose ``_cp_plan`` is None in diffusers 0.42.1
CP_PLANS = {"ErnieImageTransformer2DModel": ERNIE_IMAGE_PLAN}


def context_parallel_plan(model) -> dict:
    """The plan ``model`` runs under: its class's own ``_cp_plan``, else exactdit's."""
    plan = diffusers_internals.context_parallel_plan(model) or CP_PLANS.get(type(model).__name__)
    if plan is None:
        raise ValueError(
            f"exactdit.enable_context_parallel: {type(model).__name__} has no context-parallel plan "
            f"(diffusers ships none and exactdit has plans for {', '.join(sorted(CP_PLANS))})"
        )
    return plan


def enable_context_parallel(model, config) -> None:
    """``model.enable_parallelism(config=config, cp_plan=...)`` with :func:`context_parallel_plan`;
    ``model``: a transformer or a pipeline (its ``transformer``).

    ``config`` is a diffusers ``ContextParallelConfig`` (or ``ParallelConfig``);
    ``torch.distributed`` must be initialised, as diffusers requires.
    """
    model = getattr(model, "transformer", model)
    if not hasattr(model, "enable_parallelism"):
        raise TypeError(f"exactdit.enable_context_parallel: expected a diffusers transformer or pipeline, got "
                        f"{type(model).__name__}")
    model.enable_parallelism(config=config, cp_plan=context_parallel_plan(model))
