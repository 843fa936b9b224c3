"""The package under test is the installed one (`pip install ./python`); run from a clone
without installing, the package's sources are used with the library named by KVRELAY_LIBRARY
or built in target/release."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

try:
    import kvrelay  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "python" / "src"))
    os.environ.setdefault("KVRELAY_LIBRARY", str(ROOT / "target" / "release" / "libkvrelay.so"))
