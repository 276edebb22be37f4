import sys

from flashkern.cli import main

sys.exit(main())
