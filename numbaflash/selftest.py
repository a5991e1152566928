"""``python -m numbaflash.selftest``: a short name for :mod:`numbaflash.tools.selftest`."""

from numbaflash.tools.selftest import main

if __name__ == "__main__":
    raise SystemExit(main())
