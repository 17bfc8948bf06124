"""Activate the CPU test harness in the running interpreter's environment (a ``.pth`` file).

Run as ``python packages/hf-sglang/tests/cpu_harness/install.py`` inside the test venv.  Every
Python process of that venv then installs the import hook at start-up (see README.md).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
PTH_NAME = "hf_sglang_cpu_harness.pth"


def main() -> Path:
    target = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    target.write_text(f"{HERE}\nimport hf_sglang_cpu_harness; hf_sglang_cpu_harness.install()\n")
    print(f"CPU test harness for hf-sglang activated: {target}")
    return target


if __name__ == "__main__":
    main()
