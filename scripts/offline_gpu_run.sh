#!/usr/bin/env bash
# Runs the GPU tests and benchmarks on a CUDA machine without internet whose Python already has torch, triton and
# transformers. On the machine with internet, beforehand:
#   scripts/offline_wheels.sh                      # the other wheels, into .whl/
#   git archive -o .devsrc.tar HEAD                # the source to run
#   (the test vocabularies in .cache/testdata/llama.cpp/vocab come from scripts/fetch_test_data.py)
# then copy .whl/, .devsrc.tar, this script and .cache/testdata/llama.cpp/vocab/ggml-vocab-llama-bpe.gguf there and
# run, from the folder holding them:
#   OUT=/some/folder bash scripts/offline_gpu_run.sh gputest serve structured ...
# Each stage runs under its own time limit; its log and the benchmarks' JSON go to $OUT.
set -u
OUT=${OUT:-/tmp/poot-out}
mkdir -p "$OUT"
T0=$(date +%s)
mkdir -p /tmp/src && tar -xf .devsrc.tar -C /tmp/src
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
mkdir -p /tmp/src/.cache/testdata/llama.cpp/vocab
cp .cache/testdata/llama.cpp/vocab/*.gguf /tmp/src/.cache/testdata/llama.cpp/vocab/ 2>/dev/null
cd /tmp/src
editable=(-e .)
for p in plugins/*/; do editable+=(-e "$p"); done
python3 -m pip install -q --no-deps --no-build-isolation "${editable[@]}" >/dev/null 2>&1 || echo "editable install failed"
echo "setup $(( $(date +%s) - T0 )) s"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
stage() {
  local name=$1 limit=$2; shift 2
  local t; t=$(date +%s)
  echo "=== $name"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? $(( $(date +%s) - t )) s"
  tail -"${TAILN:-25}" "$OUT/$name.log"
}
for s in "$@"; do
  case $s in
    gputest) stage gputest 330 python3 -m pytest -q -k "not ahead_of_time" tests/triton tests/conformance ;;
    serve) stage serve 200 python3 bench/gpu_serve.py --no-hf --workloads 256x1024+128 --orders ahead,pipelined ;;
    visiontest) stage visiontest 200 python3 -m pytest -q tests/triton/test_triton_vision.py \
      tests/triton/test_triton_executor_ops.py tests/conformance/test_executor_conformance.py -k "not ahead_of_time" ;;
    caption) stage caption 120 python3 bench/caption.py --backend cuda --repeats 2 ;;
    captionprof) stage captionprof 150 python3 bench/caption.py --backend cuda --models qwen2.5-vl-3b --repeats 1 \
      --profile --out caption_profile ;;
    structured) stage structured 200 python3 bench/structured.py --backend cuda ;;
    serveload) stage serveload 200 python3 bench/serve_load.py --random llama3_8b --workloads 256x1024+128 ;;
    multi) stage multi 120 python3 bench/multi_device.py --layers 2 --new 8 ;;
    verify) stage verify 150 python3 bench/gpu_verify.py --widths 9,16 ;;
    hybrid) stage hybrid 200 python3 bench/hybrid_decode.py --reps 5 ;;
    *) echo "unknown stage $s" ;;
  esac
done
cp bench/results/*.json "$OUT"/ 2>/dev/null
echo "total $(( $(date +%s) - T0 )) s"
