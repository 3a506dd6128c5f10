import sys

from dfl_agent.cli.infer import main

sys.exit(main())
