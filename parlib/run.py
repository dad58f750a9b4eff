"""``torchrun -m parlib.run MODULE:FUNCTION``: see :mod:`parlib.runtime.torchrun`."""

from parlib.runtime.torchrun import main

if __name__ == "__main__":
    raise SystemExit(main())
