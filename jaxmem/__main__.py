"""``python -m jaxmem`` == the ``jaxmem`` command."""
import sys

from jaxmem.cli import main

sys.exit(main())
