#!/usr/bin/env bash
# Everything the H200 runs, in stages, logs under $OUT (the device tool brings them back).
#   bash benchmarks/run_on_device.sh tests     GPU test suite (torch.equal vs CUDA eager)
#   bash benchmarks/run_on_device.sh ops       per-op benchmarks
#   bash benchmarks/run_on_device.sh equality  full-model equality (ernie_equality.py)
#   bash benchmarks/run_on_device.sh model     model benchmark + profile (bench_ernie.py, profile_ernie.py)
#   bash benchmarks/run_on_device.sh ernie     equality + model
#   bash benchmarks/run_on_device.sh ncu       Nsight Compute: throughput, stalls, instructions per kernel
# diffusers is not on the GPU image: carry its wheel in .whl/ (see BENCHMARKS.md).
set -u
OUT=${OUT:-/tmp/exactdit-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
for stage in "$@"; do
  case "$stage" in
    tests)
      timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_numerics.py 2>&1 | tee "$OUT/numerics_on_gpu.log" | tail -2
      timeout 400 python3 -m pytest -q -p no:cacheprovider --maxfail=30 -m gpu tests -rf 2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^\." | tail -40 ;;
    erf)
      timeout 60 python3 benchmarks/probe_erf.py 2>&1 | tee "$OUT/probe_erf.log" | tail -6
      timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_geglu.py -rf 2>&1 | tee "$OUT/gpu_geglu.log" | grep -v "^\." | tail -12 ;;
    tune)
      timeout 200 python3 benchmarks/tune_elementwise.py 2>&1 | tee "$OUT/tune_elementwise.log" | tail -12 ;;
    ops)
      for b in "bench_elementwise.py" "bench_rms_norm.py --no-sweep" "bench_layer_norm.py" "bench_rope_geglu.py"; do
        timeout 200 python3 benchmarks/$b 2>&1 | tee -a "$OUT/bench_ops.log" | tail -14
      done ;;
    equality)
      ERNIE_EQ_BUDGET_S=${ERNIE_EQ_BUDGET_S:-150} timeout 260 python3 benchmarks/ernie_equality.py 2>&1 | tee "$OUT/ernie_equality.log" | tail -32 ;;
    model)
      ERNIE_BENCH_BUDGET_S=${ERNIE_BENCH_BUDGET_S:-120} timeout 270 python3 benchmarks/bench_ernie.py 2>&1 | tee "$OUT/bench_ernie.log" | tail -25
      timeout 150 python3 benchmarks/profile_ernie.py 2>&1 | tee "$OUT/profile_ernie.log" | grep -v Warn | tail -40 ;;
    ernie)
      bash "$0" equality model ;;
    ncu)
      timeout 200 ncu --section SpeedOfLight --section WarpStateStats --section InstructionStats \
        -k 'regex:^(rms_norm_kernel|norm_rope_kernel|geglu_kernel|layer_norm_kernel)$' -c 8 \
        python3 benchmarks/ncu_ops.py --repeat 1 > "$OUT/ncu_ops.txt" 2>&1
      grep -E "^  [a-z_]+kernel|Duration|Memory Throughput|Warp Cycles Per Issued|Executed Instructions  " "$OUT/ncu_ops.txt" ;;
  esac
done
