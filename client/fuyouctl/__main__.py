import sys

from fuyouctl.cli import main

sys.exit(main())
