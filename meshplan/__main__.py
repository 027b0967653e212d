import sys

from meshplan.cli.main import main

sys.exit(main())
