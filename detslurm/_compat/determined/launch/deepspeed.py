"""`python3 -m determined.launch.deepspeed` inside trials runs detslurm's launcher."""

import sys

from detslurm.launch.deepspeed import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
