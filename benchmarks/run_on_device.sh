#!/usr/bin/env bash
# Everything the H200 runs, in stages, logs under $OUT (the device tool brings them back).
#   bash benchmarks/run_on_device.sh tests     GPU test suite (torch.equal vs CUDA eager) but for the minis and the rules:
#                                              with minis-tests and rules-tests (below) the whole suite in three calls
# The engine (exactdit.patch on any model; one 10-minute device call fits all five):
#   engine-equality  Flux.1-dev forwards at 1024^2 B=1 and 768x1360 B=2, 28-step FluxPipeline md5, test configs
#   engine-bench     Flux.1-dev 1024^2 B=1: eager, exactdit (kernel-time breakdown, clock, power), regional compile
#   engine-tests     pytest -m gpu for the engine
#   tests-k          pytest -m gpu tests -k "$TESTS_K" (with the carried wheels on the path, as every stage)
#   unrun-tests      the GPU tests written since the last device run (2026-12-04): calls while kernels compile,
#                    group offloading (leaf level, streams, prefetch order recorded unpatched or patched), LoRA
#                    replays across adapter changes, fused GEMMs in every candidate tile configuration; a few minutes
#   engine-ernie     ERNIE-Image 1024^2 and 512^2 through the engine: one forward each, equal to eager
#   engine-chroma    diffusers' Chroma test configs
#   minis-tests      pytest -m gpu tests/minis/test_gpu_minis.py: 27 more transformer classes at tiny configs (SD3, Flux.2,
#                    HunyuanVideo, LTX-Video, Sana, ...), bf16 and fp32, patched vs eager
#   rules-tests      tests/device/test_numerics.py and tests/engine/test_gpu_rules.py: each pointwise rule against the eager CUDA kernel,
#                    special values (+-0, +-inf, NaN, subnormals), bf16 / fp16 / fp32
#   qwen-edit        Qwen-Image-Edit-2511 (zero_cond_t, a condition image stream): one forward at 1024^2
#   padded-text      Qwen-Image 1328^2 and Z-Image-Turbo 1024x1536, B=2 with prompts of 128 and 37 tokens
# CUDA-graph mode (exactdit.patch(..., cuda_graphs=True)):
#   graphs-tests     pytest -m gpu tests/patches/test_gpu_cuda_graphs.py (replays equal eager, tiny configs)
#   graphs-bench     Flux.1-dev 1024^2 (with regional compile) and 512^2, ERNIE-Image 512^2 and 1024^2: eager,
#                    exactdit, exactdit + CUDA graphs
#   graphs-equality  Flux.1-dev 28-step FluxPipeline and ERNIE-Image 50 steps, with and without graphs: md5s
#   deploy           bench_deploy.py: per model, first calls at three resolutions in a row (cold caches, then warm in a
#                    fresh process), eager / exactdit / graphs time and peak memory, graph coverage, memory left after
#                    release; MODELS="flux qwen chroma" picks (default flux; a 14B+ model takes most of a 10-minute call),
#                    DEPLOY_ARGS="--compile" adds regional compile's first calls
#   graphs-masked    bench_deploy.py --skip-first-calls: Qwen-Image 1328^2 (mask of ones; B=2 padded 128/37 tokens),
#                    1024^2 padded, Chroma 1024^2 padded: eager / exactdit / graphs time, equality, memory, coverage
#   first-calls      profile_first_call.py with regional compile's first calls in the same process: HunyuanVideo
#                    544x960x17 then 480x848x33, Flux.1-dev 1024^2 then 768x1360 (cold caches); each first call, the
#                    seconds until its last kernel compiled (calls do not wait), the second call
#   first-call-cprofile  Flux.1-dev 1024^2 first call under cProfile, cold caches then warm (twice): where the
#                    GPU host's first call goes, the first block class's "partition" second included
#   first-call-warm  Flux.1-dev 1024^2 first call in fresh processes, cold caches then warm twice, no profiler
#                    (issue 33's warm-cache first call); FIRST_CALL_RUNS="cold warm warm-lowering warm" picks the
#                    runs (warm-lowering: EXACTDIT_CAPTURE_CACHE=0, every graph lowered by AOTAutograd again)
#   new-shapes       profile_first_call.py, HunyuanVideo at 544x960x17, 480x848x33, 368x640x25, 544x960x17 again,
#                    patched with dynamic=True / None / False (DYNAMIC_MODES="first auto static"): each first call
#   new-sizes-tests  pytest -m gpu tests/minis/test_gpu_minis.py -k new_sizes: 33 minis at three batch sizes in a row under
#                    dynamic=None (static, symbolic, made concrete) or NEW_SIZES_DYNAMIC=True (symbolic from the first),
#                    equal to eager; MINIS_K="flux2 or sd3" narrows, ~8 minutes per mode
#   specialize-cpu   tests/engine/test_specialize.py (slow cases too) on the image's torch, on the CPU in Triton's
#                    interpreter: at_sizes and the indexing matched through node.meta["from_node"] on another torch
#   host             host time per call: a region through the gate, its launch plan, Triton's JIT launch, eager, a replay
# Other models at production size (bench_engine.py with regional compile and CUDA graphs):
#   models-bench     Qwen-Image 1024^2, Z-Image-Turbo 1024^2, Wan2.1-14B 480x832x33
#   minis-bench      the released models of minis with a production config (SD3.5 Large 1024^2, FLUX.2-dev 1024^2,
#                    HunyuanVideo 480x848x33, LTX-Video 704x1280x81, CogVideoX-5B 480x720x49), with regional
#                    compile; MINIS="sd3 ..." picks some
#   minis-profile    profile_engine.py on those released models: ATen ops left eager by time, regions against their floor
#   rows-adjacent    operands whose rows lie adjacent in memory (a patch embedding's flattened, transposed output):
#                    the GPU rules test, the minis with that layout, HunyuanVideo 480x848x33 with --breakdown and compile,
#                    and the sweep of the two launch knobs on its double block
# Fused GEMMs (EXACTDIT_GEMM; off by default):
#   gemm             pytest -m gpu tests/engine/test_gpu_gemm.py; bench_gemm.py --energy (fused region in each candidate
#                    tile configuration vs cuBLAS + epilogue; each way back to back: us, clock, power, mJ per call)
#   energy-floor     Flux.1-dev 1024^2: each block GEMM / attention call back to back at the power cap (NVML energy per
#                    call), summed over the forward, against the forward's own energy and power: the cap's floor, measured
#   gemm-trial       bench_gemm.py over tile configurations that are not candidates yet (two programs per
#                    multiprocessor, warp specialisation) next to the first candidate and the earlier pointer
#                    epilogue (4 stages), each forced
#   gemm-flux        Flux.1-dev 1024^2 with EXACTDIT_GEMM=auto (each signature's ways timed; the choices printed) and with
#                    every GEMM left to cuBLAS, kernel-time breakdown, clock, power, energy per forward
#   redesign-ab      the tree before the redesign (ac515ac, unpacked in .ab/before and carried) against this one in one call,
#                    alternated twice: Flux.1-dev and ERNIE-Image 1024^2, eager and exactdit each (issue 31's same-run check)
# Context parallelism (device kind nvidia-h200-x2):
#   cp               Flux.1-dev 1024^2, Wan2.1-14B 480x832x33, ERNIE-Image 1024^2: Ulysses 2 and ring 2 vs eager
#                    under the same config, and 1 GPU, in one torchrun job each (bench_context_parallel.py)
#   cp-one-gpu       when two GPUs are not lent: the same models under Ulysses 2 and ring 2 with both ranks on one
#                    GPU over gloo (context_parallel_equality.py): equality only, every kernel on its rank's shard shapes
# What users combine the model with (issue 34; bench_ecosystem.py, one process per configuration):
#   ecosystem        ECO_MODEL=flux (1024^2, default) or wan (480x832x33); ECO_CONFIGS="lora fp8-cast ..." picks
#                    configurations (default: all; bench_ecosystem.py --list names them). Each: equal to the same
#                    configuration unpatched, eager vs exactdit vs regional compile, capture whole / in parts / eager.
#                    The full list takes longer than one 10-minute call: split it with ECO_CONFIGS.
#                    ECO_ARGS="--graphs" adds exactdit with CUDA graphs (LoRA models are graphed too).
# The device's copy of the tree carries a stale .git: pass EXACTDIT_COMMIT=<hash> for the results rows' commit.
# diffusers is not on the GPU image: carry its wheel in .whl/ (see BENCHMARKS.md); for ecosystem also torchao
# 0.17.0, gguf 0.19.0 and bitsandbytes 0.50.2 (the pip download commands are in BENCHMARKS.md).
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
    tests)
      timeout 60 python3 -m pytest -q -p no:cacheprovider tests/device/test_numerics.py 2>&1 | tee "$OUT/numerics_on_gpu.log" | tail -2
      timeout 500 python3 -m pytest -q -p no:cacheprovider --maxfail=30 -m gpu tests --ignore=tests/minis \
        --ignore=tests/engine/test_gpu_rules.py -rf 2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^\." | tail -40 ;;
    engine-equality)
      timeout 165 python3 benchmarks/models/engine_equality.py --model flux --config full --forward 1024x1024x1 768x1360x2 \
        --sample-steps 28 --test-configs 2>&1 | grep -v Warn | tee "$OUT/flux_equality.log" | tail -8 ;;
    engine-bench)
      timeout 195 python3 benchmarks/models/bench_engine.py --model flux --config full --height 1024 --width 1024 --batch 1 \
        --repeat 7 --breakdown --compile 2>&1 | grep -E "^\||breakdown|DISABLED|EAGER" | tee "$OUT/flux_bench.log" ;;
    unrun-tests)
      timeout 500 python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/engine/test_gpu_engine.py \
        tests/patches/test_gpu_cuda_graphs.py tests/engine/test_gpu_gemm.py \
        -k "calls_while or group_offloaded or lora_replays or candidate_tile or way_that_raises or timed_choice or cat_along" 2>&1 | \
        tee "$OUT/gpu_unrun_tests.log" | tail -12 ;;
    tests-k)
      timeout ${TESTS_TIMEOUT_S:-300} python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests -k "${TESTS_K:?set TESTS_K}" 2>&1 | \
        tee "$OUT/gpu_tests_k.log" | grep -v "^\." | tail -30 ;;
    engine-tests)
      timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpu_engine.py -rf 2>&1 | tee "$OUT/gpu_engine_tests.log" | tail -6 ;;
    minis-tests)
      timeout 540 python3 -m pytest -q -p no:cacheprovider -m gpu tests/minis/test_gpu_minis.py -rf 2>&1 | grep -v Warn | \
        tee "$OUT/gpu_minis_tests.log" | tail -40 ;;
    rules-tests)
      timeout 60 python3 -m pytest -q -p no:cacheprovider tests/device/test_numerics.py 2>&1 | tee "$OUT/numerics_on_gpu.log" | tail -2
      timeout 480 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpu_rules.py -rf 2>&1 | \
        grep -v Warn | tee "$OUT/gpu_rules_tests.log" | tail -30 ;;
    engine-ernie)
      timeout 240 python3 benchmarks/models/engine_equality.py --model ernie --config full --forward 1024x1024x1 512x512x1 \
        2>&1 | grep -v Warn | tee "$OUT/ernie_equality.log" | tail -4 ;;
    engine-chroma)
      timeout 30 python3 benchmarks/models/engine_equality.py --model chroma --test-configs 2>&1 | grep -v Warn | \
        tee "$OUT/chroma_equality.log" | tail -4 ;;
    qwen-edit)
      timeout 240 python3 benchmarks/models/engine_equality.py --model qwen --config full --edit --forward 1024x1024x1 \
        2>&1 | grep -v Warn | tee "$OUT/qwen_edit_equality.log" | tail -4 ;;
    padded-text)
      timeout 150 python3 benchmarks/models/engine_equality.py --model qwen --config full --forward 1328x1328x2 --text-len 128 37 \
        2>&1 | grep -v Warn | tee "$OUT/qwen_padded_equality.log" | tail -3
      timeout 150 python3 benchmarks/models/engine_equality.py --model zimage --config full --forward 1024x1536x2 --text-len 128 37 \
        2>&1 | grep -v Warn | tee "$OUT/zimage_padded_equality.log" | tail -3 ;;
    graphs-tests)
      timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/patches/test_gpu_cuda_graphs.py -rf 2>&1 | \
        tee "$OUT/gpu_graphs_tests.log" | tail -8 ;;
    graphs-bench)
      timeout 240 python3 benchmarks/models/bench_engine.py --model flux --config full --height 1024 --width 1024 \
        --repeat 7 --compile --cuda-graphs --breakdown 2>&1 | grep -E "^\||breakdown|DISABLED|EAGER|graphs" | \
        tee -a "$OUT/graphs_bench.log"
      for args in "--model flux --height 512 --width 512" "--model ernie --height 512 --width 512" \
                  "--model ernie --height 1024 --width 1024"; do
        timeout 120 python3 benchmarks/models/bench_engine.py $args --config full --repeat 10 --cuda-graphs 2>&1 | \
          grep -E "^\||DISABLED|EAGER|graphs" | tee -a "$OUT/graphs_bench.log"
      done ;;
    deploy)
      for m in ${MODELS:-flux}; do
        timeout 590 python3 benchmarks/models/bench_deploy.py --models $m --timeout 190 ${DEPLOY_ARGS:-} 2>&1 | grep -v Warn | \
          tee -a "$OUT/bench_deploy.log" | grep -E "^\||^##|^graphs:|^released|error| (cold|warm|memory): "
      done ;;
    graphs-masked)
      for a in "--models qwen --resolutions 1328x1328 --mask-ones" \
               "--models qwen --resolutions 1328x1328 --batch 2 --text-len 128 37" \
               "--models qwen --resolutions 1024x1024 --batch 2 --text-len 128 37" \
               "--models chroma --resolutions 1024x1024 --batch 2 --text-len 128 37"; do
        timeout 145 python3 benchmarks/models/bench_deploy.py $a --skip-first-calls --timeout 140 2>&1 | grep -v Warn | \
          tee -a "$OUT/graphs_masked.log" | grep -E "^\||^##|^graphs:|^released|error"
      done ;;
    first-calls)
      timeout 280 python3 benchmarks/models/profile_first_call.py --mini hunyuan-video --resolutions 544x960x17 480x848x33 \
        --compile 2>&1 | grep -v Warn | tee "$OUT/first_calls_hunyuan.log" | grep -E "call:|^first calls"
      timeout 200 python3 benchmarks/models/profile_first_call.py --model flux --config full --resolutions 1024x1024 768x1360 \
        --compile 2>&1 | grep -v Warn | tee "$OUT/first_calls_flux.log" | grep -E "call:|^first calls" ;;
    first-call-cprofile)
      # warm twice: the first warm run fills the environment's caches, the second finds them
      for caches in cold warm warm; do
        timeout 150 python3 benchmarks/models/profile_first_call.py --model flux --config full --resolutions 1024x1024 \
          --no-eager-warmup --cprofile --caches $caches 2>&1 | grep -v Warn | tee -a "$OUT/first_call_cprofile.log" | \
          grep -E "call:|^first calls|^  [A-Z]"
      done ;;
    first-call-warm)
      for run in ${FIRST_CALL_RUNS:-cold warm warm}; do  # warm-lowering: warm caches but AOTAutograd lowers every graph
        caches=${run%-lowering}; lowering=1; [ "$run" = warm-lowering ] && lowering=0
        echo "== $run"
        EXACTDIT_CAPTURE_CACHE=$lowering timeout 100 python3 benchmarks/models/profile_first_call.py --model flux \
          --config full --resolutions 1024x1024 --no-eager-warmup --caches $caches 2>&1 | grep -v Warn | \
          tee -a "$OUT/first_call_warm.log" | grep -E "^==|call:|^first calls|^lowered graphs"
      done ;;
    new-shapes)
      for mode in ${DYNAMIC_MODES:-first auto static}; do
        timeout 190 python3 benchmarks/models/profile_first_call.py --mini hunyuan-video --dynamic $mode \
          --resolutions 544x960x17 480x848x33 368x640x25 544x960x17 2>&1 | grep -v Warn | \
          tee -a "$OUT/new_shapes_hunyuan.log" | grep -E "call:|^first calls|^built"
      done ;;
    new-sizes-tests)
      timeout 560 python3 -m pytest -v -p no:cacheprovider -m gpu tests/minis/test_gpu_minis.py -k "new_sizes and ${NEW_SIZES_DYNAMIC:-None}${MINIS_K:+ and ($MINIS_K)}" -rf \
        2>&1 | grep -E "PASS|FAIL|Error|passed|failed" | tee "$OUT/gpu_minis_new_sizes.log" | tail -40 ;;
    specialize-cpu)
      TRITON_INTERPRET=1 timeout 400 python3 -m pytest -q -p no:cacheprovider -m "not gpu" -rf \
        tests/engine/test_specialize.py 2>&1 | grep -v Warn | tee "$OUT/specialize_cpu.log" | tail -8 ;;
    host)
      timeout 150 python3 benchmarks/kernels/bench_host_overhead.py --calls 3000 2>&1 | grep -v Warn | tee "$OUT/host_overhead.log" | tail -30 ;;
    graphs-equality)
      timeout 200 python3 benchmarks/models/engine_equality.py --model flux --config full --forward 1024x1024x1 \
        --sample-steps 28 --cuda-graphs 2>&1 | grep -v Warn | tee "$OUT/flux_graphs_equality.log" | tail -6
      timeout 200 python3 benchmarks/models/engine_equality.py --model ernie --config full --sample-steps 50 --cuda-graphs \
        2>&1 | grep -v Warn | tee "$OUT/ernie_graphs_equality.log" | tail -4 ;;
    models-bench)
      for args in "--model qwen --height 1024 --width 1024" "--model zimage --height 1024 --width 1024" \
                  "--model wan --height 480 --width 832 --frames 33"; do
        timeout 280 python3 benchmarks/models/bench_engine.py $args --config full --repeat 5 --compile --cuda-graphs 2>&1 | \
          grep -E "^\||DISABLED|EAGER|graphs|built" | tee -a "$OUT/models_bench.log"
      done ;;
    minis-bench)
      for mini in ${MINIS:-sd3 ltx-video cogvideox hunyuan-video flux2}; do
        timeout 240 python3 benchmarks/models/bench_engine.py --mini $mini --repeat 5 --compile 2>&1 | \
          grep -E "^\||DISABLED|EAGER|built" | tee -a "$OUT/minis_bench.log"
      done ;;
    minis-profile)
      for mini in ${MINIS:-sd3 cogvideox hunyuan-video}; do
        timeout 240 python3 benchmarks/models/profile_engine.py --mini $mini 2>&1 | grep -v Warn | \
          tee -a "$OUT/minis_profile.log" | grep -E "left to|model|^\|" | head -40
      done ;;
    rows-adjacent)
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpu_rules.py -k rows_adjacent -rf 2>&1 | \
        grep -v Warn | tee "$OUT/gpu_rows_adjacent.log" | tail -6
      timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/minis/test_gpu_minis.py \
        -k "hunyuan or wan-vace or skyreels or sana or pixart" -rf 2>&1 | grep -v Warn | tee "$OUT/gpu_minis_rows_adjacent.log" | tail -6
      timeout 240 python3 benchmarks/models/bench_engine.py --mini hunyuan-video --repeat 3 --compile --breakdown 2>&1 | \
        grep -E "^\||breakdown|DISABLED|EAGER|built|kernels by" | tee -a "$OUT/hunyuan_video_bench.log"
      timeout 240 python3 benchmarks/kernels/tune_region_templates.py --template rows_adjacent --mini hunyuan-video \
        --graph HunyuanVideoTransformerBlock 2>&1 | grep -v Warn | tee "$OUT/tune_rows_adjacent.log" | tail -40 ;;
    redesign-ab)
      # the tree before the redesign (.ab/before: `bash benchmarks/run_on_device.sh` does not make it; make it here with
      # mkdir -p .ab/before && git archive ac515ac | tar -x -C .ab/before, and carry .ab) against this one, on the same
      # machine in one call, alternated twice: Flux.1-dev 1024^2 and ERNIE-Image 1024^2 (AB_MODELS picks), eager in each
      for round in 1 2; do
        for m in ${AB_MODELS:-flux ernie}; do
          (cd .ab/before && OUT="$OUT/before" EXACTDIT_CACHE=/tmp/exactdit-cache-before PYTHONPATH=/tmp/site:$PWD timeout 150 python3 benchmarks/bench_engine.py \
            --model $m --config full --height 1024 --width 1024 --repeat 10 2>&1 | grep -E "^\||DISABLED|EAGER" | \
            sed "s/^/before ac515ac, round $round: /" | tee -a "$OUT/redesign_ab.log")
          timeout 150 python3 benchmarks/models/bench_engine.py --model $m --config full --height 1024 --width 1024 \
            --repeat 10 2>&1 | grep -E "^\||DISABLED|EAGER" | sed "s/^/now, round $round: /" | tee -a "$OUT/redesign_ab.log"
        done
      done
      # the old tree's rows name whatever commit the device's stale .git says: name theirs
      [ -f "$OUT/before/results.jsonl" ] && python3 -c "import json,sys
for l in open(sys.argv[1]): print(json.dumps(json.loads(l) | {'commit': 'ac515ac (before the redesign)'}))" \
        "$OUT/before/results.jsonl" >> "$OUT/results.jsonl" && rm -r "$OUT/before" ;;
    cp)
      for args in "--model flux --height 1024 --width 1024" "--model wan --height 480 --width 832 --frames 33" \
                  "--model ernie --height 1024 --width 1024"; do
        timeout 420 torchrun --nproc-per-node 2 benchmarks/parallel/bench_context_parallel.py --config full $args --repeat 5 \
          2>&1 | grep -E "^\||GPU|skipped|x2" | tee -a "$OUT/context_parallel.log"
      done ;;
    cp-one-gpu)
      for args in "--model flux --height 1024 --width 1024" "--model ernie --height 1024 --width 1024" \
                  "--model wan --height 480 --width 832 --frames 33"; do
        timeout 300 torchrun --nproc-per-node 2 benchmarks/parallel/context_parallel_equality.py --backend gloo --config full \
          --modes ulysses ring $args 2>&1 | grep -E "^\||exitcode" | tee -a "$OUT/context_parallel_equality.log"
      done ;;
    ecosystem)
      case "${ECO_MODEL:-flux}" in
        wan) geometry="--model wan --height 480 --width 832 --frames 33" ;;
        *) geometry="--model flux --height 1024 --width 1024" ;;
      esac
      configs=${ECO_CONFIGS:-$(python3 benchmarks/models/bench_ecosystem.py --list 2>/dev/null | awk '{print $1}')}
      for c in $configs; do
        t=${ECO_TIMEOUT_S:-240}; case "$c" in gguf*) t=${ECO_GGUF_TIMEOUT_S:-540} ;; esac  # quantizes on the CPU
        timeout $t python3 benchmarks/models/bench_ecosystem.py $geometry --config full --repeat 5 ${ECO_ARGS:-} \
          --configs "$c" 2>&1 | grep -v Warn | tee -a "$OUT/ecosystem_${ECO_MODEL:-flux}.log" | \
          grep -E "^\||^\[" | tail -8
      done ;;
    gemm)
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpu_gemm.py -rf 2>&1 | \
        tee "$OUT/gpu_gemm_tests.log" | tail -6
      timeout 360 python3 benchmarks/kernels/bench_gemm.py --energy 2>&1 | grep -v Warn | tee "$OUT/bench_gemm.log" | tail -40 ;;
    energy-floor)
      timeout 560 python3 benchmarks/models/energy_floor.py --model flux --config full --height 1024 --width 1024 \
        2>&1 | grep -v Warn | tee "$OUT/energy_floor_flux.log" | tail -30 ;;
    gemm-trial)
      timeout 500 python3 benchmarks/kernels/bench_gemm.py --tiles 128,256,64,8,3,1,0,2 128,128,64,8,2,2,0,2 \
        128,256,64,8,3,1,1,2 128,256,64,8,4,1,0,1,0 \
        2>&1 | grep -v Warn | tee "$OUT/bench_gemm_trial.log" | tail -60 ;;
    gemm-flux)
      timeout 540 python3 benchmarks/models/bench_engine.py --model flux --config full --height 1024 --width 1024 \
        --gemm auto --gemm-off-too --breakdown 2>&1 | grep -E "^\||^gemm |breakdown|DISABLED|EAGER" | tee "$OUT/flux_gemm.log" ;;
  esac
done
