import sys

from opreg.cli import main

sys.exit(main())
