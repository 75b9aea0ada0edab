"`python -m dtnb ...`: the `dtnb` command (hand-written, like `__init__.py`: nbdev generates no `__main__`)"
import sys
from dtnb.cli import main

if __name__ == '__main__': sys.exit(main())
