"""kvcert-prereg: lock, verify and render the pre-registration (the command line of kvcert.analysis.prereg).

Kept apart from kvcert.analysis.prereg because the command also locks and verifies the exploratory held-out specs
(kvcert.analysis.heldout), which hash their files with prereg's ``sha256``: the library must not import them back.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcert.analysis.errors import AnalysisError
from kvcert.analysis.prereg import (
    __doc__ as PREREG_DOC,
    _renderings,
    find_root,
    is_draft,
    load_amendment,
    newest,
    read_lock,
    verify_lock,
    versions,
    write_lock,
)
from kvcert.atomic import write_text_atomic


# --- CLI -----------------------------------------------------------------------------------------


def _cmd_lock(args) -> str:
    if args.exploratory:  # an exploratory study's held-out spec (kvcert.analysis.heldout), no version of the claims
        from kvcert.analysis.heldout import write_spec_lock

        return f"wrote {write_spec_lock(args.root, args.exploratory, force=args.force)}"
    return f"wrote {write_lock(args.root, force=args.force, number=args.amendment or 1)}"


def _cmd_verify(args) -> str:
    known = versions(args.root)
    present = [n for n in known if n == 1 or (Path(args.root) / known[n].document).is_file()]
    drafts = [n for n in present if n > 1 and not (Path(args.root) / known[n].lock).is_file()
              and is_draft(load_amendment(args.root, n))]
    upto = args.version or max(n for n in present if n not in drafts)
    verify_lock(args.root, upto)
    locks = [read_lock(args.root, n) for n in range(1, upto + 1)]
    from kvcert.analysis.heldout import locked_scales, verify_spec_lock

    specs = [(scale, verify_spec_lock(args.root, scale)) for scale in locked_scales(args.root)]
    return "; ".join([f"version {n} lock OK ({len(lock['files'])} files, locked {lock.get('locked_at_utc', '?')})"
                      for n, lock in enumerate(locks, start=1)]
                     + [f"version {n} is a draft (not locked)" for n in drafts if n > upto]
                     + [f"exploratory {scale} lock OK ({len(lock['files'])} files, locked "
                        f"{lock.get('locked_at_utc', '?')})" for scale, lock in specs])


def _cmd_render(args) -> str:
    done = []
    for rel, text in _renderings(Path(args.root)).items():
        target = Path(args.root) / rel
        if args.check:
            if not target.is_file() or target.read_text() != text:
                raise AnalysisError(f"{rel} differs from the render of its document: run kvcert-prereg render")
            done.append(f"{rel} is up to date")
        else:
            write_text_atomic(text, target)
            done.append(f"wrote {target}")
    return "; ".join(done)


def _cmd_newest(args) -> str:
    return str(newest(args.root))


COMMANDS = {"lock": _cmd_lock, "verify": _cmd_verify, "render": _cmd_render, "newest": _cmd_newest}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcert-prereg", description=PREREG_DOC.splitlines()[0])
    parser.add_argument("--root", default=None, help="repository root (default: nearest parent with preregistration/)")
    sub = parser.add_subparsers(dest="command", required=True)
    lock = sub.add_parser("lock", help="freeze claims.yaml (or an amendment) and the analysis code")
    lock.add_argument("--force", action="store_true", help="overwrite an existing lock")
    lock.add_argument("--amendment", type=int, default=None, help="lock amendment N instead of version 1")
    lock.add_argument("--exploratory", default=None, metavar="SCALE",
                      help="lock the held-out spec preregistration/exploratory/SCALE.yaml with the code deciding it")
    verify = sub.add_parser("verify", help="check the frozen files against every lock")
    verify.add_argument("--version", type=int, default=None, help="check versions 1..N only (default: all)")
    rend = sub.add_parser("render", help="write PREREGISTRATION.md from claims.yaml")
    rend.add_argument("--check", action="store_true", help="only check that PREREGISTRATION.md is up to date")
    sub.add_parser("newest", help="print the highest version number (the amendment `make lock-amendment` freezes)")
    args = parser.parse_args(argv)
    try:
        args.root = Path(args.root) if args.root else find_root()
        print(COMMANDS[args.command](args))
    except AnalysisError as exc:
        print(f"kvcert-prereg: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
