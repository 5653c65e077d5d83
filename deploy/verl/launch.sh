#!/usr/bin/env bash
# Launch a verl GRPO run whose rollout is done by the adaptive-rollout sampler.
#
#   deploy/verl/launch.sh sampler [extra `adaptive-rollout serve` flags]   # on the inference node(s)
#   deploy/verl/launch.sh trainer [extra hydra overrides]                  # on the training head node
#   deploy/verl/launch.sh sampler-config                                   # print the sampler's config
#
# The sampler owns the prompts, the verification and the domain mixing; verl owns the
# optimization. Both read these variables (defaults in brackets):
#
#   MODEL           model directory or HF id both sides start from (required)
#   DATA            sampler prompt files, comma-separated .jsonl/.parquet (sampler; required)
#   SAMPLER_URL     where the trainer finds the sampler [http://127.0.0.1:8000]
#   SAMPLER_PORT    sampler port [8000]
#   GROUP_SIZE      answers per group = verl's actor_rollout_ref.rollout.n [4]
#   WAVE_SIZE       answers per sampler wave; at least GROUP_SIZE, so every group is full
#                   [max(8, GROUP_SIZE)]
#   N_MAX           answers per prompt at most [4 x WAVE_SIZE]
#   TEMPERATURE     sampling temperature, the same on both sides [1.0]
#   MAX_TOKENS      answer length cap (sampler max_tokens = verl max_response_length) [2048]
#   TRAIN_BATCH     groups per step (verl train_batch_size = sampler batch_groups) [64]
#   MINI_BATCH      verl ppo_mini_batch_size, in groups [16]
#   STEPS           trainer.total_training_steps [100]
#   NNODES, GPUS_PER_NODE   training nodes and GPUs per node [1, 8]
#   SAMPLER_TP      vLLM tensor parallel size on the sampler [1]
#   GPU_MEMORY      share of each sampler GPU vLLM takes (weights + KV cache) [the backend's
#                   0.45, which leaves a trainer on the same GPU room; 0.9 on GPUs of its own]
#   WEIGHT_SYNC     upload | path [upload]; path needs WEIGHTS_DIR on storage both sides mount
#   WEIGHTS_DIR     shared directory for weight files (path mode)
#   STATE_DIR       sampler state (SQLite store, accepted weights) [sampler_state]
#   RULE            sampler stopping rule: fixed (plain GRPO) | balanced | positive [balanced]
#   ADVANTAGE       sampler advantage estimator: global (Reinforce-Ada) | grpo [global]
#   ADAPTIVE_ROLLOUT_API_KEY   API key, if the sampler requires one
#   PYTHON          interpreter with adaptive-rollout installed [.venv-vllm/bin/python for the
#                   sampler (make venv-vllm), .venv-verl/bin/python for the trainer (make venv-verl)]
#
# Multi-node training: start Ray first (`ray start --head` on the head node, `ray start
# --address=HEAD:6379` on the others) and run the trainer role on the head node; the
# config sends VERL_USE_EXTERNAL_MODULES to every Ray worker.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
role=${1:-}
shift || true
# The two sides live in different environments: verl 0.9.1 pins transformers < 5.11,
# vLLM 0.32 needs >= 5.16 (DESIGN.md section 11).
if [[ -z "${PYTHON:-}" ]]; then
  venv=.venv-verl
  [[ "$role" == sampler ]] && venv=.venv-vllm
  if [[ -x $venv/bin/python ]]; then PYTHON=$ROOT/$venv/bin/python; else PYTHON=python3; fi
fi
: "${SAMPLER_URL:=http://127.0.0.1:8000}" "${SAMPLER_PORT:=8000}" "${GROUP_SIZE:=4}" "${TEMPERATURE:=1.0}"
: "${MAX_TOKENS:=2048}" "${TRAIN_BATCH:=64}" "${MINI_BATCH:=16}" "${STEPS:=100}" "${NNODES:=1}"
: "${GPUS_PER_NODE:=8}" "${SAMPLER_TP:=1}" "${WEIGHT_SYNC:=upload}" "${STATE_DIR:=sampler_state}"
: "${RULE:=balanced}" "${ADVANTAGE:=global}"

: "${WAVE_SIZE:=$(( GROUP_SIZE > 8 ? GROUP_SIZE : 8 ))}"
: "${N_MAX:=$(( 4 * WAVE_SIZE ))}"

# The sampler's config (`launch.sh sampler-config` prints it). group_size must equal
# rollout.n; waves of at least group_size answers guarantee every group has exactly that
# many samples (the trainer checks this at start-up).
sampler_config() {
  cat <<JSON
{"rule": "$RULE", "k_pos": 2, "k_neg": 2, "wave": "fixed", "wave_size": $WAVE_SIZE,
 "n_max": $N_MAX, "group_size": $GROUP_SIZE, "downsample": "balanced",
 "advantage": "$ADVANTAGE", "temperature": $TEMPERATURE, "max_tokens": $MAX_TOKENS,
 "batch_groups": $TRAIN_BATCH, "max_buffered_groups": $((TRAIN_BATCH * 4)),
 "max_staleness": 1, "group_policies": [{"name": "nonzero_std", "params": {}}]}
JSON
}

case "$role" in
  sampler-config)
    sampler_config
    ;;
  sampler)
    : "${MODEL:?set MODEL}" "${DATA:?set DATA (comma-separated prompt files)}"
    config=$(mktemp --suffix=.json)
    sampler_config > "$config"
    data_args=()
    IFS=, read -ra files <<< "$DATA"
    for f in "${files[@]}"; do data_args+=(--data "$f"); done
    vllm_args=(--vllm-arg "tensor_parallel_size=$SAMPLER_TP")
    [[ -n "${GPU_MEMORY:-}" ]] && vllm_args+=(--vllm-arg "gpu_memory_utilization=$GPU_MEMORY")
    exec "$PYTHON" -m sampler_service serve --backend vllm --model "$MODEL" "${data_args[@]}" \
      --host 0.0.0.0 --port "$SAMPLER_PORT" --state-dir "$STATE_DIR" --config "$config" \
      "${vllm_args[@]}" "$@"
    ;;
  trainer)
    : "${MODEL:?set MODEL}"
    export VERL_USE_EXTERNAL_MODULES=trainer_client.verl.v1 ADAPTIVE_ROLLOUT_URL="$SAMPLER_URL"
    pacing=${PACING_DATA:-$ROOT/pacing.parquet}
    "$PYTHON" -m trainer_client.verl.pacing --out "$pacing" --rows $((TRAIN_BATCH * 16)) >/dev/null
    weights=()
    if [[ "$WEIGHT_SYNC" == path ]]; then
      : "${WEIGHTS_DIR:?WEIGHT_SYNC=path needs WEIGHTS_DIR (shared storage)}"
      weights=(trainer.v1.adaptive_rollout.weights_dir="$WEIGHTS_DIR")
    fi
    exec "$PYTHON" -m verl.trainer.main_ppo \
      --config-path="$ROOT/deploy/verl" --config-name=sampler_grpo \
      trainer.v1.adaptive_rollout.url="$SAMPLER_URL" \
      trainer.v1.adaptive_rollout.weight_sync="$WEIGHT_SYNC" "${weights[@]}" \
      actor_rollout_ref.model.path="$MODEL" \
      actor_rollout_ref.rollout.n="$GROUP_SIZE" \
      actor_rollout_ref.rollout.temperature="$TEMPERATURE" \
      data.train_files="$pacing" data.val_files="$pacing" \
      data.train_batch_size="$TRAIN_BATCH" data.max_response_length="$MAX_TOKENS" \
      actor_rollout_ref.actor.ppo_mini_batch_size="$MINI_BATCH" \
      trainer.total_training_steps="$STEPS" \
      trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$GPUS_PER_NODE" \
      "$@"
    ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
