"""``python -m numbaflash.bench``: a short name for :mod:`numbaflash.tools.bench`."""

from numbaflash.tools.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
