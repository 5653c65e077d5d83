#!/usr/bin/env bash
# GPU check of the verl integration: a full short verl 0.9 GRPO run, V1 trainer
# in the `adaptive_rollout` mode, against a running sampler.
#
# Needs one CUDA GPU and an environment with verl 0.9.1 (GPU build) and this project
# (`make venv-verl` on a GPU host). PYTHON selects the interpreter (default
# .venv-verl/bin/python if present, else python3). Nothing is downloaded: the toy model
# and data are built locally. What it does:
#
#   1. builds the toy model/data and starts `adaptive-rollout serve` (transformers backend,
#      on the GPU when SAMPLER_DEVICE=cuda, default cpu) with groups of 4;
#   2. runs `python -m verl.trainer.main_ppo` with deploy/verl/sampler_grpo.yaml for
#      STEPS (3) steps on 1 GPU: FSDP actor, no rollout engine, groups from the sampler,
#      weights pushed back after every step;
#   3. checks that the sampler's policy version rose to STEPS, that every group verl took
#      was acked (nothing left leased) and that verl logged the sampler metrics.
#
# Exit status 0 when all checks pass; the verl log is in $WORK/verl.log.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv-verl/bin/python ]]; then PYTHON=$ROOT/.venv-verl/bin/python; else PYTHON=python3; fi
fi
STEPS=${STEPS:-3}
SAMPLER_DEVICE=${SAMPLER_DEVICE:-cpu}
WORK=${WORK:-$(mktemp -d /tmp/verl_gpu_check.XXXXXX)}
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 RAY_USAGE_STATS_ENABLED=0 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export VERL_USE_EXTERNAL_MODULES=trainer_client.verl.v1
command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "nvidia-smi not found"
"$PYTHON" - <<'PY'
import torch, verl
print(f"verl {verl.__version__}  torch {torch.__version__}  cuda devices {torch.cuda.device_count()}")
assert torch.cuda.is_available(), "this check needs a CUDA GPU"
PY

echo "== toy model and data in $WORK"
"$PYTHON" - "$WORK" <<'PY'
import sys
from pathlib import Path
from sampler_service.toy import build_toy
paths = build_toy(Path(sys.argv[1]) / "toy", seed=0)
(Path(sys.argv[1]) / "data_files").write_text("\n".join(str(p) for p in paths.data_files))
PY
cat > "$WORK/sampler.json" <<'JSON'
{"rule": "fixed", "group_size": 4, "wave_size": 4, "n_max": 8, "advantage": "grpo",
 "temperature": 1.0, "max_tokens": 16, "batch_groups": 4, "max_buffered_groups": 32,
 "max_active_prompts": 32}
JSON
data_args=()
while read -r f; do data_args+=(--data "$f"); done < "$WORK/data_files"

echo "== sampler"
"$PYTHON" -m sampler_service serve --model "$WORK/toy/model" "${data_args[@]}" --port 0 \
  --device "$SAMPLER_DEVICE" --dtype float32 --state-dir "$WORK/state" --config "$WORK/sampler.json" \
  > "$WORK/sampler.out" 2> "$WORK/sampler.log" &
SAMPLER_PID=$!
trap 'kill $SAMPLER_PID 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  URL=$(grep -o 'http://[0-9.]*:[0-9]*' "$WORK/sampler.out" | head -1 || true)
  [[ -n "$URL" ]] && curl -sf "$URL/ready" >/dev/null && break
  sleep 1
done
[[ -n "${URL:-}" ]] || { echo "sampler did not start"; tail -50 "$WORK/sampler.log"; exit 1; }
echo "sampler at $URL"

echo "== verl ($STEPS steps)"
"$PYTHON" -m trainer_client.verl.pacing --out "$WORK/pacing.parquet" --rows 64 >/dev/null
set +e
timeout "${VERL_TIMEOUT_S:-1500}" "$PYTHON" -m verl.trainer.main_ppo \
  --config-path="$ROOT/deploy/verl" --config-name=sampler_grpo \
  trainer.v1.adaptive_rollout.url="$URL" \
  actor_rollout_ref.model.path="$WORK/toy/model" \
  actor_rollout_ref.model.enable_gradient_checkpointing=false \
  actor_rollout_ref.rollout.n=4 \
  data.train_files="$WORK/pacing.parquet" data.val_files="$WORK/pacing.parquet" \
  data.train_batch_size=4 data.max_prompt_length=64 data.max_response_length=16 \
  actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.actor.optim.lr=1e-4 \
  trainer.total_training_steps="$STEPS" trainer.save_freq=-1 trainer.n_gpus_per_node=1 trainer.nnodes=1 \
  trainer.default_local_dir="$WORK/checkpoints" ray_kwargs.ray_init.num_cpus=8 \
  "$@" 2>&1 | tee "$WORK/verl.log"
rc=${PIPESTATUS[0]}
set -e
[[ $rc -eq 0 ]] || { echo "verl exited with $rc (log: $WORK/verl.log)"; exit "$rc"; }

echo "== checks"
"$PYTHON" - "$URL" "$STEPS" "$WORK/verl.log" <<'PY'
import sys
from trainer_client.client import SamplerClient
url, steps, log = sys.argv[1], int(sys.argv[2]), open(sys.argv[3]).read()
client = SamplerClient(url)
version = client.health().policy_version
stats = client.stats()
print(f"sampler policy version {version}, queue {stats['queue']}")
failures = []
if version < steps:
    failures.append(f"policy version {version} < {steps} steps: weights were not pushed every step")
if stats["queue"]["leased"]:
    failures.append(f"{stats['queue']['leased']} groups still leased: not every group verl took was acked")
if "adaptive_rollout/policy_version" not in log:
    failures.append("verl did not log adaptive_rollout/policy_version")
for f in failures:
    print("FAIL:", f)
sys.exit(1 if failures else 0)
PY
echo "verl GPU check passed"
