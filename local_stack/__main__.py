import sys

from local_stack.stack import main

sys.exit(main())
