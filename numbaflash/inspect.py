"""``python -m numbaflash.inspect``: a short name for :mod:`numbaflash.tools.inspect`."""

from numbaflash.tools.inspect import main

if __name__ == "__main__":
    raise SystemExit(main())
