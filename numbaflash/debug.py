"""``python -m numbaflash.debug``: a short name for :mod:`numbaflash.tools.debug`."""

from numbaflash.tools.debug import main

if __name__ == "__main__":
    raise SystemExit(main())
