"""``python -m numbaflash.precompile``: a short name for :mod:`numbaflash.tools.precompile`."""

from numbaflash.tools.precompile import main

if __name__ == "__main__":
    raise SystemExit(main())
