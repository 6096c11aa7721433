"""Mini models: more diffusers transformer classes at tiny configs, each with one forward's inputs.

The fully specified models (:mod:`exactdit.harness.models`: Flux.1, Qwen-Image, Z-Image, Wan,
ERNIE-Image, ...) carry production configs, pipelines and sampling. A mini model is only what a
compatibility check needs: the class, a tiny config (two or more repeated blocks, small widths)
and a function giving one forward's keyword arguments. Everything model-specific is data here;
the checks that run them are generic (``tests/minis/test_minis.py`` on the CPU, ``tests/minis/test_gpu_minis.py``).
Entries: :mod:`.image` (image transformers), :mod:`.video` (video transformers).
"""

from tests.minis.core import (  # noqa: F401
    Grid, InputsFn, MINIS, Mini, Production, TEXT_LEN, build, compute_dtype, forward_inputs, mini,
    production_of, randn, text_mask, timesteps,
)
from tests.minis import image as _image, video as _video  # noqa: E402,F401  (entries register themselves)
