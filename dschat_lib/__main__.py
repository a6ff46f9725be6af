import sys

from dschat_lib.cli import main

sys.exit(main())
