"""`python -m jaxengine.server [MODEL] [flags]`: the same as `jaxengine serve`."""

import sys

from jaxengine.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
