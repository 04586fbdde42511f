"""Progress of long materializations: a tqdm bar of chunks done while a split plan runs, shown when
the run is expected to take longer than about two seconds, on a terminal only (stderr a TTY), and
never when ``LAZYMEM_PROGRESS`` is off (0, false, off: the flags' one parse, core/config.h). The C++ executor calls ``report`` (installed at import)."""

from __future__ import annotations

import sys
from typing import Any

_bar: Any = None


def _wanted() -> bool:
    from . import _C

    if _C._env_flag("LAZYMEM_PROGRESS") is False:
        return False
    stream = sys.stderr
    return bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())


def report(done: int, total: int, finished: bool) -> None:
    global _bar
    if _bar is None:
        if finished or not _wanted():
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        _bar = tqdm(total=total, desc="lazymem", unit="chunk", leave=False, dynamic_ncols=True)
    _bar.total = total
    _bar.n = done
    _bar.refresh()
    if finished:
        _bar.close()
        _bar = None
