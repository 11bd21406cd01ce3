"""``python -m fp8fx``: the ``fp8fx`` command (``fp8fx.cli``)."""
import sys

from fp8fx.cli import main

sys.exit(main())
