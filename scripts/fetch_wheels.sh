#!/usr/bin/env bash
# Wheels the GPU machine lacks, for the benchmarks' baselines and the model part
# (Liger, transformers 5.x and its dependencies), downloaded for its Python (3.12,
# manylinux x86_64) into .whl/ (git-ignored via .git/info/exclude; name it in the
# device tool's `carry`). scripts/gpu_call.sh installs them with --no-deps into /tmp/site.
# torch's own dependencies (typing_extensions, filelock, fsspec, packaging) are left out, and
# so are what the device image holds already (numpy 2.5, tokenizers 0.23, safetensors 0.8)
# and hf_xet (downloads only; the device is offline): the carry (the tracked tree, ~24 MiB,
# results/ included, plus .whl) must stay under the device tool's 64 MiB; with them it was
# 69 MiB and the call was refused (thirty-second session).
set -e
cd "$(dirname "$0")/.."
mkdir -p .whl /tmp/codetta-wheels
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64"
# shellcheck disable=SC2086
pip download -q --no-deps $plat -d .whl liger-kernel==0.8.5
# shellcheck disable=SC2086
pip download -q --no-deps $plat -d .whl pytest-xdist execnet  # (gpu_call.sh TEST_WORKERS)
# shellcheck disable=SC2086
pip download -q $plat -d /tmp/codetta-wheels "transformers==5.24.0"
for f in /tmp/codetta-wheels/*.whl; do
  case $(basename "$f") in
    typing_extensions*|filelock*|fsspec*|packaging*|numpy*|tokenizers*|safetensors*|hf_xet*) ;;
    *) cp "$f" .whl/ ;;
  esac
done
du -sh .whl
