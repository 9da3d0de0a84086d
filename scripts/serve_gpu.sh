#!/usr/bin/env bash
# Serve an LLM/VLM export with vLLM on this GPU node, tensor-parallel over every visible GPU:
#   export KILN_API_KEY=<secret>    # clients send it as "Authorization: Bearer <secret>"
#   scripts/serve_gpu.sh serve.model=<run.dir>/export [serve.KEY=VALUE ...]   (later keys win; KILN_PYTHON=...)
# It listens on every interface (0.0.0.0), so it needs the key (serve.api_key_env names another variable)
# or serve.allow_unauthenticated=true; the key goes to vLLM in its environment, never on a command line.
# KILN_PYTHON: the python of the serving venv (pip install -e '.[serve-gpu]', README: Installing on a GPU node).
# A model whose head count the GPU count does not divide (the tiny ones): add serve.tensor_parallel_size=1.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -v CUDA_VISIBLE_DEVICES ]]; then  # set by SLURM and users; empty hides every GPU
  IFS=, read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
  gpus=${#visible[@]}
else
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
(( gpus > 0 )) || { echo "kiln: error: no GPU visible on $(hostname) (CUDA_VISIBLE_DEVICES, nvidia-smi)" >&2; exit 2; }

export HF_HUB_OFFLINE=1                   # exports are local folders; compute nodes often have no internet
export VLLM_WORKER_MULTIPROC_METHOD=spawn # tensor-parallel workers must not fork an initialized CUDA context
export TOKENIZERS_PARALLELISM=false       # silence the fork warning of HF tokenizers in vLLM's workers

# The serving venv first (vLLM pins its own torch: README, Installing on a GPU node), then the training one.
python=${KILN_PYTHON:-$(for p in .venv-serve/bin/python .venv/bin/python; do [[ -x $p ]] && { echo "$p"; exit; }; done; echo python3)}
exec "$python" scripts/serve.py serve.engine=vllm serve.host=0.0.0.0 serve.tensor_parallel_size="$gpus" "$@"
