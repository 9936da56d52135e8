"""`python3 -m determined.launch.tensorflow` inside trials runs detslurm's launcher."""

import sys

from detslurm.launch.tensorflow import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
