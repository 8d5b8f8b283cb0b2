"""A locked copy of the pre-registration and the frozen analysis code, for tests that run claims."""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def locked_copy(dst: Path) -> Path:
    """preregistration/ and src/kvcert/analysis/ under ``dst``, locked afresh (``dst`` is a prereg_root)."""
    from kvcert.analysis import prereg

    shutil.copytree(ROOT / "preregistration", dst / "preregistration", ignore=shutil.ignore_patterns("prereg.lock"))
    shutil.copytree(ROOT / "src" / "kvcert" / "analysis", dst / "src" / "kvcert" / "analysis",
                    ignore=shutil.ignore_patterns("__pycache__"))
    prereg.write_lock(dst)
    return dst
