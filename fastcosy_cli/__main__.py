"""``python -m fastcosy_cli``: the ``fastcosy`` console script without its wrapper."""
import sys

from fastcosy_cli.main import main

sys.exit(main())
