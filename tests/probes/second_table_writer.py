# SPDX-License-Identifier: Apache-2.0
"""A second accuracy-table run on the same JSON: takes its writer lock, which must refuse while
the test holds it (the refusal goes to stderr, exit status non-zero).

Usage: python tests/probes/second_table_writer.py TABLE_JSON
"""

import sys
from pathlib import Path

from fp4_moe_lab.accuracy import table

if __name__ == "__main__":
    table.hold_writer_lock(Path(sys.argv[1]))
