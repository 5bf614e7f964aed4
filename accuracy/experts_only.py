# SPDX-License-Identifier: Apache-2.0
"""`python accuracy/experts_only.py`: runs :mod:`fp4_moe_lab.accuracy.experts_only` (usage
there), with the Python of .venv, where the lab is installed."""

import sys

from fp4_moe_lab.accuracy.experts_only import main

if __name__ == "__main__":
    sys.exit(main())
