"""`python3 -m determined.launch.wrap_rank` inside trials runs detslurm's launcher."""

import sys

from detslurm.launch.wrap_rank import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
