"""The package's version (``numbaflash.__version__``, the same as ``pyproject.toml``'s): kept at
the bottom layer, so that the compile cache's key (``compiler.toolchain_versions``) reads it
without importing the package top."""

VERSION = "0.1.0"
