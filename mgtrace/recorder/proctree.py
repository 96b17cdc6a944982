"""A vLLM engine's process tree, read from /proc: API server → EngineCore → workers."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
# a recording's own assembler processes (children of the workers): never a target
ASSEMBLER_MODULE = "mgtrace.recorder.outproc"
# Python's and torch's helper processes, spawned under an engine but never running a model:
# reaching for them would only name them as not recorded on every run
HELPER_MARKERS = (
    "multiprocessing.resource_tracker",
    "_inductor/compile_worker",
    "_inductor.compile_worker",
)


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    uid: int
    name: str  # comm, which vLLM sets to e.g. VLLM::EngineCore / VLLM::Worker_TP0
    cmdline: str

    @property
    def role(self) -> str:
        text = f"{self.name} {self.cmdline}"
        if ASSEMBLER_MODULE in self.cmdline:
            return "mgtrace-assembler"
        if any(marker in self.cmdline for marker in HELPER_MARKERS):
            return "helper"
        if "EngineCore" in text:
            return "engine-core"
        if "Worker" in text:
            return "worker"
        if "vllm" in text.lower():
            return "api-server"
        return "other"

    @property
    def is_python(self) -> bool:
        """Whether the process runs CPython: its executable is an interpreter, or it maps one
        (an interpreter started through the dynamic loader, whose executable is the loader,
        or a program that embeds libpython)."""
        try:
            exe = os.readlink(PROC / str(self.pid) / "exe")
        except OSError:
            return "python" in self.cmdline.split(" ", 1)[0]
        return "python" in Path(exe).name or maps_python(self.pid)


_PYTHON_IMAGE = re.compile(r"(lib)?python\d")  # python3.12, libpython3.12.so.1.0


def maps_python(pid: int) -> bool:
    """Whether ``pid`` has a Python interpreter or libpython mapped."""
    try:
        with open(PROC / str(pid) / "maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                path = line.rstrip("\n").split(maxsplit=5)[5:]
                if path and _PYTHON_IMAGE.match(path[0].rsplit("/", 1)[-1]):
                    return True
    except OSError:
        pass
    return False


def read_proc(pid: int) -> Proc | None:
    base = PROC / str(pid)
    try:
        stat = (base / "stat").read_text()
        status = (base / "status").read_text()
        cmd = (base / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    # comm may contain spaces and parentheses: it ends at the last ')'
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
    uid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:"))
    return Proc(pid=pid, ppid=ppid, uid=uid, name=name, cmdline=cmd.strip())


def all_procs() -> dict[int, Proc]:
    out = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            p = read_proc(int(entry.name))
            if p is not None:
                out[p.pid] = p
    return out


def tree(root: int) -> list[Proc]:
    """``root`` and all its descendants, parents before children."""
    procs = all_procs()
    if root not in procs:
        return []
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(procs[pid])
        todo.extend(sorted(children.get(pid, [])))
    return out


def engine_processes(procs: list[Proc], has_agent: Callable[[Proc], bool]) -> list[Proc]:
    """Of ``procs`` (parents before children), the engine's: vLLM's own processes (by name
    or command line), those with an agent, and everything under one of them. A shell or
    supervisor above the engine, and its other children, are left alone, and so are
    mgtrace's own assembler processes and Python's and torch's helper processes without an
    agent (and anything under them)."""
    inside: set[int] = set()
    skipped: set[int] = set()
    for p in procs:
        helper = p.role == "helper" and not has_agent(p)
        if p.role == "mgtrace-assembler" or helper or p.ppid in skipped:
            skipped.add(p.pid)
        elif p.role != "other" or p.ppid in inside or has_agent(p):
            inside.add(p.pid)
    return [p for p in procs if p.pid in inside]
