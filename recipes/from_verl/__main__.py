"""python -m recipes.from_verl: see recipes.from_verl."""

import sys

from recipes.from_verl.cli import main

if __name__ == "__main__":
    sys.exit(main())
