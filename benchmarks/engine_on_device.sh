#!/usr/bin/env bash
# The engine's GPU proof and benchmarks, in stages; logs and JSON under $OUT.
#   bash benchmarks/engine_on_device.sh equality bench tests ernie chroma
# diffusers is not on the GPU image: carry its wheel in .whl/ (see BENCHMARKS.md).
set -u
OUT=${OUT:-/tmp/exactdit-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 EXACTDIT_CACHE=${EXACTDIT_CACHE:-/tmp/exactdit-cache}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
for stage in "$@"; do
  case "$stage" in
    equality)  # Flux.1-dev: forwards at 1024^2 B=1 and 768x1360 B=2, 28-step sampling md5, diffusers' test configs
      timeout 165 python3 benchmarks/engine_equality.py --model flux --config full --forward 1024x1024x1 768x1360x2 \
        --sample-steps 28 --test-configs 2>&1 | grep -v Warn | tee "$OUT/flux_equality.log" | tail -8 ;;
    bench)  # Flux.1-dev 1024^2 B=1: eager, exactdit (kernel-time breakdown, clock, power), regional compile
      timeout 195 python3 benchmarks/bench_engine.py --model flux --config full --height 1024 --width 1024 --batch 1 \
        --repeat 7 --breakdown --compile 2>&1 | grep -E "^\||breakdown|DISABLED|EAGER" | tee "$OUT/flux_bench.log" ;;
    tests)
      timeout 115 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_gpu_layer_norm.py \
        tests/test_gpu_rope.py -rf 2>&1 | tee "$OUT/gpu_tests.log" | tail -6 ;;
    ernie)  # ERNIE-Image through the engine: the md5s of earlier sessions
      ERNIE_EQ_BUDGET_S=30 timeout 75 python3 benchmarks/ernie_equality.py 2>&1 | tee "$OUT/ernie_equality.log" | \
        grep -E "md5|EQUAL|DIFFERENT|skipped" | tail -12 ;;
    chroma)
      timeout 30 python3 benchmarks/engine_equality.py --model chroma --test-configs 2>&1 | grep -v Warn | \
        tee "$OUT/chroma_equality.log" | tail -4 ;;
  esac
done
