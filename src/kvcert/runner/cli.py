"""``kvcert-run``: the Hydra app that runs one cell.

Configs are composed with Hydra's compose API from the package's ``conf/`` (``configs/run/`` at the
repository root), so overrides work as in any Hydra app (``data=jsonl data.path=f.jsonl``,
``'budgets=[0.25,0.5]'``) while every failure ends in one line naming the key, value or file.
``--cfg`` prints the composed config and exits.
"""

from __future__ import annotations

import sys
import traceback

from ..errors import UsageError
from ..hydra_app import check_top_level_keys, compose_or_show, missing_keys, one_line


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = compose_or_show(argv, __doc__)
        if cfg is None:
            return 0
        check_top_level_keys(cfg)
        missing = missing_keys(cfg)
        if missing:
            raise UsageError(f"missing value for {', '.join(missing)} (set it on the command line, e.g. {missing[0]}=...)")
        from .cell import run_cell

        out = run_cell(cfg, cfg.out_dir)
    except KeyboardInterrupt:
        print("kvcert-run: interrupted; finished items are kept and a rerun resumes", file=sys.stderr)
        return 130
    except (UsageError, ValueError, OSError, RuntimeError, KeyError) as err:
        print(f"kvcert-run: error: {one_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:  # a bug, not bad input: keep the traceback, but still end on one line
        traceback.print_exc(file=sys.stderr)
        print(f"kvcert-run: error: internal error ({type(err).__name__}: {one_line(err)}); "
              "please report it with the traceback above", file=sys.stderr)
        return 1
    print(f"kvcert-run: wrote {out}/items.parquet and {out}/steps.parquet", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
