"""``python -m gridtrain.cli``: the ``gridtrain`` command without its console script."""

import sys

from gridtrain.cli.main import main

sys.exit(main())
