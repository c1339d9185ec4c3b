"""`python -m stalwart.cli` is the `stalwart` command."""
import sys

from stalwart.cli import main

sys.exit(main())
