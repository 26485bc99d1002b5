import sys

from runmap.cli.main import main

sys.exit(main())
