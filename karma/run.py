"""`python -m karma.run SCHEDULE.yaml ...`: karma-run, for launchers that want a module."""

import sys

from karma.cli.run import main

if __name__ == "__main__":
    sys.exit(main())
