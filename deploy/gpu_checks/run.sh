#!/usr/bin/env bash
# The verl GPU check: the sampler (hf backend) on CUDA, then 3 verl GRPO steps against it
# in the adaptive_rollout trainer mode, in float32 (rollout_probs_diff_max < 1e-3 at every
# step) and in bfloat16 (rollout_probs_diff_mean < 1e-3), each checking that the policy
# version advanced and every group used was acked. Both phases took 264 s on one H200.
#
#   deploy/gpu_checks/run.sh [--out DIR] [--cpu-dry-run] [--dtypes LIST] [--verl-timeout-s S]
#
#   --out DIR       where the log (run.log), summary.json, the sampler's and verl's logs go
#                   [a new directory under /tmp]
#   --cpu-dry-run   every stage but verl's FSDP steps, on CPU with the toy model (what
#                   `make test-gpu-bundle` runs, so the script cannot rot)
#   --dtypes LIST   the GPU phases, comma-separated [float32,bfloat16]
#   --verl-timeout-s S  how long one phase's verl run may take [420]
#
# A machine without network gets the Python packages it lacks from the wheel bundle
# (`make gpu-bundle`): with BUNDLE=DIR (e.g. .gpu-bundle/cp312) the wheels are installed
# with `pip install --no-index --no-deps --target DIR.site` first (once) and put ahead of
# the preinstalled packages. PYTHON selects the interpreter [python3]. Nothing is
# downloaded; the toy model is built locally. Exit status 0 iff every check passed.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
out="" dry=() pass=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --cpu-dry-run) dry=(--cpu-dry-run); shift ;;
    --dtypes|--verl-timeout-s) pass+=("$1" "$2"); shift 2 ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2 ;;
  esac
done
[[ -n "$out" ]] || out=$(mktemp -d /tmp/verl_gpu_check.XXXXXX)
mkdir -p "$out"
out=$(cd "$out" && pwd)
PYTHON=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 RAY_USAGE_STATS_ENABLED=0 DO_NOT_TRACK=1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0
# The check's Ray is a private single-machine instance, run as the verl test suite runs
# it: without token authentication (with it, TransferQueue's start-up was seen waiting
# for its storage actors' addresses until killed).
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
pythonpath=$ROOT
if [[ -n "${BUNDLE:-}" ]]; then
  site=$(cd "$BUNDLE" && pwd).site
  if [[ ! -f "$site/.installed" ]] || [[ "$BUNDLE/manifest.json" -nt "$site/.installed" ]]; then
    rm -rf "$site"
    "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
      --target "$site" "$BUNDLE"/*.whl
    touch "$site/.installed"
  fi
  pythonpath=$site:$pythonpath
fi
# Ray's workers and verl's actors inherit the environment: they see the same packages.
export PYTHONPATH="$pythonpath${PYTHONPATH:+:$PYTHONPATH}"
command -v nvidia-smi >/dev/null && nvidia-smi -L || true
"$PYTHON" deploy/gpu_checks/verl_check.py --out "$out" "${dry[@]}" "${pass[@]}" 2>&1 | tee "$out/run.log"
exit "${PIPESTATUS[0]}"
