"""``python -m fastdata`` runs the ``fastdata`` command."""
import sys

from fastdata.cli import main

sys.exit(main())
