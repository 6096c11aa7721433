"""Launch constants of ATen's CUDA norm kernels (``layer_norm_kernel.cu``, torch 2.11, sm_90) that the
device library reproduces; the order models of these kernels (what each thread adds, in which order)
are the tests' references, ``tests/aten/norms_model.py``."""

#: threads per block of ``vectorized_layer_norm_kernel`` on CUDA:
#: dim3(warp_size, num_threads() / warp_size) = (32, 4), num_threads() = 128.
VEC_THREADS = 128
VEC_WARPS = 4
#: elements per vector load, fixed at 4 for every dtype (ATen keeps it
#: dtype-independent so float and half give the same reduction tree).
VEC_SIZE = 4
#: threads per block of the non-vectorised ``RowwiseMomentsCUDAKernel``
#: (``cuda_utils::kCUDABlockReduceNumThreads``).
ROWWISE_THREADS = 512
WARP = 32
