#!/usr/bin/env bash
# GPU check for a lent accelerator (issue 10): one bounded, prepared run; table printed last.
# Usage on the device machine (repo root):  bash bench/gpu_check.sh        (logs under $OUT)
set -uo pipefail
OUT=${OUT:-data/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
{
  echo "== versions"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
  $PY - <<'PY'
import importlib
for m in ("torch", "torch_geometric", "numba", "triton", "numpy", "scipy", "fastapi"):
    try:
        print(f"{m} {importlib.import_module(m).__version__}")
    except Exception as e:
        print(f"{m} missing ({type(e).__name__})")
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available())
PY
} 2>&1 | tee "$OUT/versions.txt"
# the package from this tree, without installing (the image has its own torch)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
timeout 480 $PY bench/gpu_check.py --device cuda --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
# Maestro: measured single-GPU training steps and attention beside maestro estimate's prediction
timeout 300 $PY bench/maestro_gpu_step.py --device cuda --out "$OUT" 2>&1 | tee "$OUT/maestro_gpu_step.log"
exit "$rc"
