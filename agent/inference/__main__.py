import sys

from agent.inference.cli import main

sys.exit(main())
