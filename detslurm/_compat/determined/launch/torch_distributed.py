"""`python3 -m determined.launch.torch_distributed` inside trials runs detslurm's launcher."""

import sys

from detslurm.launch.torch_distributed import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
