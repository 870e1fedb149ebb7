import sys

from local_stack.cluster.stack import main

sys.exit(main())
