# SPDX-License-Identifier: Apache-2.0
"""`python accuracy/dead_scale.py`: runs :mod:`fp4_moe_lab.accuracy.dead_scale` (usage there), with
the Python of .venv, where the lab is installed."""

import sys

from fp4_moe_lab.accuracy.dead_scale import main

if __name__ == "__main__":
    sys.exit(main())
