import sys

from flashkern_cli import main

sys.exit(main())
