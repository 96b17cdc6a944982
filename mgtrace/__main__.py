import sys

from mgtrace.cli import main

sys.exit(main())
