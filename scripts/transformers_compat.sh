#!/usr/bin/env bash
# The drop-in's tests under other transformers releases than CI's (which installs the newest):
# the `hf` extra allows any transformers >= 4.53 (the first with the mask builders the drop-in
# calls), and 4.53-5.1 differ in the mask builders' and the attention lookup's API, 4.x in the
# config's RoPE fields and when checkpointing hooks the embeddings (NOTES.md, sessions 50, 56).
# Each version in a venv of its own over this Python's packages (torch from the system: no
# download), with what that release asks for (huggingface_hub 1.x before 5.2x, 0.x before 5.0)
# and an older `kernels` package (0.19 breaks importing transformers 5.0's models, and 4.x's).
# CPU, through the interpreter.
# Usage (repo root): bash scripts/transformers_compat.sh [VERSION ...]
#   (default: 4.53.3 4.57.6 5.0.0 5.10.1 5.20.0)
#   pytest arguments through COMPAT_TESTS (default: tests/test_hf.py)
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
for version in "${@:-4.53.3 4.57.6 5.0.0 5.10.1 5.20.0}"; do
  for v in $version; do
    venv=/tmp/codetta-transformers-$v
    if [ ! -x "$venv/bin/python" ]; then
      python3 -m venv --system-site-packages "$venv"
      "$venv/bin/pip" install -q "transformers==$v" "kernels==0.11.7" || { status=1; continue; }
    fi
    "$venv/bin/python" -c "import transformers; print('transformers', transformers.__version__)"
    # shellcheck disable=SC2086
    PYTHONPATH=. "$venv/bin/python" -m pytest -q -n 2 -p no:cacheprovider ${COMPAT_TESTS:-tests/test_hf.py} \
      || status=1
  done
done
exit $status
