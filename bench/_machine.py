"""What every benchmark records about the machine it ran on."""

from __future__ import annotations

import platform
import subprocess


def cpu_model() -> str:
    """``lscpu``'s "Model name" (the CPU varies between sessions), else the platform's."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
