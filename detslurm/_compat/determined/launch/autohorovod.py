"""`python3 -m determined.launch.autohorovod` runs detslurm's launcher."""

import sys

from detslurm.launch.autohorovod import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
