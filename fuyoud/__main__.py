import sys

from fuyoud.cli import main

sys.exit(main())
