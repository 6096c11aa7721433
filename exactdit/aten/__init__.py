"""ATen's facts, in plain PyTorch: the order in which its CUDA reductions add (the generic
``mean``, ``F.rms_norm``, ``F.layer_norm``), the launch geometry they run in, and the order
models CPU tests hold the generated kernels to. The lowest layer: imports nothing of exactdit."""
