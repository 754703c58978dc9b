#!/usr/bin/env bash
# bash benchmarks/gpu_check.sh [--steps 20] [--warmup 3] [--arms qlora,mebp,mebp_lcsb] [--out gpu_check.json]
#                              [--seq-len 256] [--shape tiny|qwen2.5_0.5b]
# The GPU path on a CUDA machine, with $PYTHON (default python3) holding a CUDA build of torch, transformers, peft,
# bitsandbytes and lightning (this checkout is put on PYTHONPATH, so it need not be installed):
#   0. the arguments and the device first: without CUDA it exits 2 with a message naming torch.cuda.is_available();
#   1. the tests that need CUDA (test_on_cuda_* in tests/test_gpu_check.py; tests/test_mebp_*.py have none),
#      skips reported; a failure is reported at the end, after the measurements (one device session, both results);
#   2. peak CUDA memory and step time of qlora / mebp / mebp_lcsb: a markdown table, the JSON at --out
#      (a relative --out is relative to the directory the script is started from).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" PYTHONUNBUFFERED=1
"$py" -m benchmarks.gpu_check --preflight "$@"
tests=0
"$py" -m pytest -q -rs "$root/tests/test_gpu_check.py" -k on_cuda || tests=$?
"$py" -m benchmarks.gpu_check "$@"
if [[ $tests -ne 0 ]]; then
    echo "gpu_check.sh: the CUDA tests failed (pytest exit code $tests); the measurements above ran anyway" >&2
    exit "$tests"
fi
