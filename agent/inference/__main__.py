import sys

from dfl_agent.inference.cli import main

sys.exit(main())
