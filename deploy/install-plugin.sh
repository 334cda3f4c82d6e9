#!/bin/sh
# Install vllm-mamba-align into vLLM's Python and check it: the image recipe's
# build step (deploy/Dockerfile), also usable on any host that runs vLLM.
#
#   sh install-plugin.sh SPEC      SPEC: a source directory, a wheel, or
#                                  vllm-mamba-align==VERSION
#   PYTHON=/path/to/python sh install-plugin.sh SPEC   (default: python3)
#
# Fails (non-zero) when the install would change vLLM or torch, when the plugin
# cannot be imported, when it would refuse to start a hybrid model in align
# mode, or when vLLM would not load it with this environment's VLLM_PLUGINS.
set -eu
PYTHON="${PYTHON:-python3}"
SPEC="${1:?usage: install-plugin.sh SPEC (source directory, wheel or vllm-mamba-align==VERSION)}"

versions() {
    "$PYTHON" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'
}

before="$(versions)"
echo "install-plugin: before: $before"
if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    "$PYTHON" -m pip install --no-cache-dir "$SPEC"
elif command -v uv >/dev/null 2>&1; then
    uv pip install --system --python "$PYTHON" "$SPEC"
else
    echo "install-plugin: neither pip nor uv is available for $PYTHON" >&2
    exit 1
fi
after="$(versions)"
if [ "$before" != "$after" ]; then
    echo "install-plugin: installing the plugin changed vLLM or torch ($before -> $after): pin them" >&2
    exit 1
fi
"$PYTHON" -m vllm_mamba_align doctor --strict
