"""``python -m attnkit``: the demo (as ``attnkit demo``); with arguments, any ``attnkit`` command.

python -m attnkit                 # the demo
python -m attnkit explain --help  # the same as: attnkit explain --help
"""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["demo"]))
