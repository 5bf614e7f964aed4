# SPDX-License-Identifier: Apache-2.0
"""`python accuracy/gate_up_split.py`: runs :mod:`fp4_moe_lab.accuracy.gate_up_split` (usage
there), with the Python of .venv, where the lab is installed."""

import sys

from fp4_moe_lab.accuracy.gate_up_split import main

if __name__ == "__main__":
    sys.exit(main())
