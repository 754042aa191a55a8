"""Line PCs as the modest machines they are, and nodes timed before they serve.

A local campus runs every node on one machine. :func:`cap_cpu` makes a line PC's compute
modest: it puts chosen threads (an edge agent's model threads, named by
:mod:`sluicegate.threads`) in a cgroup v1 CPU group limited to a share of one core, which
leaves the agent's messaging threads alone. :func:`calibrate` does what a plant engineer
does on each node at install, ``sluicegate models bench``: it times every shipped model
(:func:`sluicegate.vision.priors.measure`), under the same cap where there is one, and
writes the figures as service-time priors into a models folder of links to the shipped
files, from which that node then serves.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from sluicegate.errors import SluicegateError
from sluicegate.vision.priors import PRIORS_FILE, Prior, measure, write_priors
from sluicegate.vision.runtime import ModelRegistry, default_models_dir

__all__ = ["calibrate", "cap_cpu", "cpu_cap_available", "named_threads"]

CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000  # short: a slow CPU, not one that stalls for tens of ms


def cpu_cap_available() -> bool:
    """Whether :func:`cap_cpu` can work here (a writable cgroup v1 CPU hierarchy, which is
    what lets single threads be capped)."""
    return (CGROUP_V1 / "cpu.cfs_quota_us").exists() and os.access(CGROUP_V1, os.W_OK)


def named_threads(pid: int, name: str) -> list[int]:
    """Thread ids of ``pid`` whose OS name is ``name`` (see :mod:`sluicegate.threads`)."""
    tids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            if (task / "comm").read_text().strip() == name:
                tids.append(int(task.name))
    return tids


def cap_cpu(tids: list[int], share: float, name: str) -> Path:
    """Put threads ``tids`` in a new CPU cgroup limited to ``share`` of one core."""
    if not tids:
        raise SluicegateError(f"no threads to cap for {name}")
    quota = max(1000, int(PERIOD_US * share))  # the kernel refuses less than 1 ms
    group = CGROUP_V1 / name
    try:
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
        for tid in tids:
            (group / "tasks").write_text(str(tid))
    except OSError as exc:
        raise SluicegateError(
            f"cannot cap threads {tids} to {share:.0%} of a core: no writable CPU cgroup ({exc})"
        ) from exc
    return group


# Figures measured by this process, by (share, runs): a bench that starts several campuses
# (its arms, its rounds) times the models once, and every arm starts from the same priors.
_MEASURED: dict[tuple[float | None, int], list[Prior]] = {}


def calibrate(folder: Path, share: float | None, *, runs: int = 3) -> tuple[Path, list[Prior]]:
    """Time every shipped model on a thread capped to ``share`` of a core (None: uncapped)
    and write the figures as priors into ``folder``, beside links to the shipped files.
    Timed once per process for each ``share`` and ``runs``: a second call writes the same
    figures."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in default_models_dir().iterdir():
        if path.suffix in (".json", ".onnx") and not (folder / path.name).exists():
            (folder / path.name).symlink_to(path.resolve())
    known = _MEASURED.get((share, runs))
    if known is not None:
        write_priors(folder / PRIORS_FILE, known)
        return folder, list(known)
    registry = ModelRegistry.from_dir(folder)
    found: list[Prior] = []
    failed: list[BaseException] = []
    group = CGROUP_V1 / f"sluicegate-calibrate-{os.getpid()}"

    def timed() -> None:
        tid = threading.get_native_id()
        try:
            if share is not None:
                cap_cpu([tid], share, group.name)
            found.extend(measure(registry, batch=8, runs=runs))
        except BaseException as exc:  # raised again below, on the caller's thread
            failed.append(exc)
        finally:
            if share is not None:  # back to the root group, so this one can be removed
                with contextlib.suppress(OSError):
                    (CGROUP_V1 / "tasks").write_text(str(tid))

    thread = threading.Thread(target=timed, name="sg-calibrate")
    thread.start()
    thread.join()
    if share is not None:
        with contextlib.suppress(OSError):
            group.rmdir()  # empty: its one thread went back to the root group
    if failed:
        raise failed[0]
    write_priors(folder / PRIORS_FILE, found)
    _MEASURED[(share, runs)] = list(found)
    return folder, found
