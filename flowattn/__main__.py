"""``python -m flowattn``: the same command line as the ``flowattn`` script."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
