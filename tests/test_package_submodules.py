"""After ``import kvcert`` alone, the submodules the docs name as ``kvcert.<module>.<name>`` resolve on first use (in
a fresh interpreter, where nothing has imported them yet), and an unknown name is still an AttributeError."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
import kvcert
assert "kvcert.presses" not in sys.modules
kvcert.presses.register_pipeline()            # docs/library.md: before any press exists
assert kvcert.targets.TargetNotMetWarning.__name__ == "TargetNotMetWarning"
try:
    kvcert.no_such_name
except AttributeError as err:
    assert "no_such_name" in str(err)
else:
    raise SystemExit("kvcert.no_such_name resolved")
"""


def test_the_submodules_the_docs_name_resolve_after_import_kvcert():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
