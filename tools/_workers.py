"""Child-process workers for the tools' long runs (opinfo_report.py, program_fuzz.py), so that a segfault,
an abort or a hang costs one worker and not the run.

A worker is the tool's own script in worker mode, started with ``--items FILE`` (a JSON list of the
items to run, in order) and ``--out FILE``, to which it appends JSON lines as it goes (Emitter):

    {"event": "ready"}                         imports done: from here on, a death is an item's doing
    {"event": "start", "item": X, ...}         the worker begins item X (extra fields: Run.info[X])
    {"event": <anything>, ...}                 a record of the item begun last (Run.started[X])
    {"event": "end", "item": X}                item X is finished (its records move to Run.done[X])

and any other event outside an item lands in Run.events. The parent (Scheduler) starts the workers in
sessions of their own, watches the file grow, kills a worker that writes nothing for ``timeout``
seconds (``startup_timeout`` before its first line), retries a worker that dies before "ready" up to
``startup_attempts`` times (an extension being rebuilt), and reads back what each worker finished, so
that the items a dead worker had finished keep their results. Scheduler.map runs batches on a pool of
threads and asks the tool what to run next after each worker: the tool's policy (a batch that died is
rerun one item per process to find the culprit, ...) stays in the tool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parent.parent
STARTUP_ATTEMPTS = 5  # a worker that dies before running anything (e.g. the extension being rebuilt)


# ----------------------------------------------------------------------------------------------------
# Worker side.


class Emitter:
    """Appends the protocol's JSON lines to `path`, each flushed at once (a worker that dies keeps what
    it wrote)."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a")  # noqa: SIM115 - closed by __exit__

    def __enter__(self) -> Emitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def emit(self, event: str, **fields: Any) -> None:
        self.file.write(json.dumps({"event": event, **fields}) + "\n")
        self.file.flush()

    def ready(self) -> None:
        self.emit("ready")

    def start(self, item: Any, **fields: Any) -> None:
        self.emit("start", item=item, **fields)

    def end(self, item: Any) -> None:
        self.emit("end", item=item)


def read_items(path: str) -> list[Any]:
    return json.loads(Path(path).read_text())


def listed(variable: str, item: Any) -> bool:
    """Whether `item` is in the comma-separated list in environment variable `variable` (the tools'
    self-tests of the scheduler: OPINFO_REPORT_FAKE_CRASH, PROGRAM_FUZZ_FAKE_*)."""
    return str(item) in set(filter(None, os.environ.get(variable, "").split(",")))


def segfault() -> None:
    import ctypes

    ctypes.string_at(0)  # SIGSEGV


def hang() -> None:
    while True:
        time.sleep(60)


# ----------------------------------------------------------------------------------------------------
# Parent side.


class Task(NamedTuple):
    """Items for one worker, a tag for the tool's policy, and extra arguments for the worker."""

    items: list[Any]
    tag: str = ""
    args: Sequence[str] = ()


@dataclasses.dataclass
class Run:
    """What one worker process did."""

    items: list[Any]
    tag: str = ""
    returncode: int | None = None
    timed_out: bool = False
    timeout: float = 0.0
    ready: bool = False
    done: dict[Any, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)  # finished items
    started: dict[Any, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)  # unfinished
    info: dict[Any, dict[str, Any]] = dataclasses.field(default_factory=dict)  # "start" fields
    events: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # outside any item
    stderr: str = ""

    @property
    def died(self) -> bool:
        return self.timed_out or self.returncode != 0

    @property
    def how(self) -> str:
        if self.timed_out:
            return f"timed out ({self.timeout:g} s without progress)"
        rc = self.returncode or 0
        if rc < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-rc).name}"
            return f"killed by signal {-rc}"
        return f"exit status {rc}"

    def stderr_tail(self, lines: int = 12) -> str:
        keep = [
            line[:300]
            for line in self.stderr.rstrip().splitlines()
            if not line.startswith("Extension modules:")
        ]
        return "\n".join(keep[-lines:])


class Scheduler:
    """Runs workers: `command` and then ``--out FILE --items FILE`` and the task's arguments."""

    def __init__(
        self,
        command: Sequence[str],
        workdir: str,
        timeout: float,
        *,
        startup_timeout: float | None = None,
        startup_attempts: int = STARTUP_ATTEMPTS,
        env: dict[str, str] | None = None,
    ) -> None:
        self.command = list(command)
        self.workdir = workdir
        self.timeout = timeout
        self.startup_timeout = timeout if startup_timeout is None else startup_timeout
        self.startup_attempts = max(1, startup_attempts)
        self.env = dict(env or {})
        self.counter = itertools.count(1)  # next() is atomic: worker files get distinct names
        self.live: set[subprocess.Popen[bytes]] = set()
        self.lock = threading.Lock()
        self.stopping = False

    def stop(self) -> None:
        """Kills the running workers (their sessions are their own: Ctrl-C does not reach them) and
        starts no more."""
        with self.lock:
            self.stopping = True
            for proc in self.live:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)

    def run(self, task: Task) -> Run:
        """Runs a worker over the task's items, retrying a worker that dies before it is ready."""
        run = Run(list(task.items), task.tag)
        for attempt in range(self.startup_attempts):
            run = self._run_once(task)
            if run.ready or not run.died or self.stopping:
                return run
            if attempt + 1 < self.startup_attempts:
                time.sleep(3 * 2**attempt)  # 3, 6, 12, 24 s: long enough for a rebuild of the extension
        return run

    def map(self, jobs: int, tasks: Sequence[Task], handle: Callable[[Run], list[Task] | None]) -> bool:
        """Runs `tasks` on `jobs` workers at once. After each worker, handle(run) (called in this thread)
        returns the tasks to run next, or None to stop: the running workers are killed and map returns
        False. An exception (Ctrl-C) kills the workers too."""
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            pending: dict[Future[Run], None] = {pool.submit(self.run, t): None for t in tasks}
            try:
                while pending:
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in done:
                        del pending[fut]
                        more = handle(fut.result())
                        if more is None:
                            self.stop()
                            return False
                        for t in more:
                            pending[pool.submit(self.run, t)] = None
            except BaseException:
                self.stop()
                raise
        return True

    def _run_once(self, task: Task) -> Run:
        base = os.path.join(self.workdir, f"w{next(self.counter)}")
        out_path, err_path, items_path = base + ".jsonl", base + ".err", base + ".items.json"
        Path(items_path).write_text(json.dumps(list(task.items)))
        cmd = [*self.command, "--out", out_path, "--items", items_path, *task.args]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.setdefault("PYTHONFAULTHANDLER", "1")
        env.update(self.env)
        run = Run(list(task.items), task.tag)
        with open(err_path, "w") as err, self.lock:
            if self.stopping:
                run.returncode = -signal.SIGKILL
                return run
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env, start_new_session=True
            )
            self.live.add(proc)
        try:
            last_size, last_change = -1, time.monotonic()
            while proc.poll() is None:
                time.sleep(0.1)
                size = os.path.getsize(out_path) if os.path.exists(out_path) else 0
                limit = self.timeout if size else self.startup_timeout  # before its first line: starting
                if size != last_size:
                    last_size, last_change = size, time.monotonic()
                elif time.monotonic() - last_change > limit:
                    run.timed_out, run.timeout = True, limit
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
        finally:
            with self.lock:
                self.live.discard(proc)
        run.returncode = proc.returncode
        run.stderr = Path(err_path).read_text(errors="replace")
        _parse(run, out_path)
        return run


def _parse(run: Run, out_path: str) -> None:
    if not os.path.exists(out_path):
        return
    current: Any = None
    for line in Path(out_path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        event = rec.pop("event", None)
        if event == "ready":
            run.ready = True
        elif event == "start":
            current = rec.pop("item")
            run.started[current] = []
            run.info[current] = rec
        elif event == "end" and current is not None:
            run.done[current] = run.started.pop(current)
            current = None
        elif current is not None:
            run.started[current].append(rec)
        elif event is not None:
            run.events[event] = rec


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
