import sys

from .cli import main

if __name__ == "__main__":  # `specontext serve` spawns the model's process, which imports this module
    sys.exit(main())
