"""Run inside gdb's own Python (``gdb -x``), never imported by mgtrace: queue a Python
source string in the attached process with ``Py_AddPendingCall``.

Why not gdb's ``call``: on some kernels gdb cannot write the x86 extended register state
("Couldn't write extended state status"), so every inferior call fails, after gdb has
already set ``orig_rax`` to -1; a thread stopped inside a system call then returns the
kernel's internal restart code to its caller (``time.sleep`` raised ``OSError: [Errno
514]``). This script touches only the general-purpose registers and memory:

1. It picks a thread stopped inside a system call (the main thread when it is one). At a
   system-call site every vector register is dead under the x86-64 calling convention, so
   the function it calls may clobber them; a thread stopped elsewhere is never used.
2. It saves that thread's general-purpose registers.
3. It re-executes the thread's own ``syscall`` instruction as an anonymous ``mmap`` (no
   allocator, so no lock that a stopped thread could hold) and writes the source there. The
   page stays mapped: the pending call reads it later (one page per attach).
4. It calls ``Py_AddPendingCall(PyRun_SimpleString, page)`` on a private stack frame whose
   return address is the program's entry point, with a temporary breakpoint there.
5. It writes every saved register back, so that the interrupted system call restarts as
   the kernel would have restarted it, and detaches.

Input: the environment variable MGTRACE_PAYLOAD. Output: one line starting with
``mgtrace-gdb:``, then ``queued``, ``busy`` (no thread in a system call just now),
``starting`` (the interpreter is not initialized yet: step 4 is preceded by a call of
``Py_IsInitialized``) or ``failed REASON``.
"""

from __future__ import annotations

import os
import re

import gdb  # type: ignore[import-not-found]  # gdb's embedded module

SAVED = (
    "rip", "rsp", "rbp", "rax", "rbx", "rcx", "rdx", "rsi", "rdi",
    "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "eflags", "orig_rax",
)  # fmt: skip
SYSCALL = b"\x0f\x05"
NR_MMAP, PROT_RW, MAP_PRIVATE_ANON = 9, 0x3, 0x22
PAGE = 4096
MAX_STOPS = 64  # other threads' stops to let pass while the call runs


INTERRUPTED: list[bool] = []


def _on_stop(event: gdb.StopEvent) -> None:
    """gdb got SIGINT (mgtrace gave up waiting): the call is abandoned, the registers go
    back, gdb detaches; ``continue`` itself just returns."""
    if isinstance(event, gdb.SignalEvent) and event.stop_signal == "SIGINT":
        INTERRUPTED.append(True)


def reg(name: str) -> int:
    gdb.newest_frame().select()
    return int(gdb.parse_and_eval(f"${name}"))


def set_reg(name: str, value: int) -> None:
    """Write a register of the thread itself. ``$name`` is the selected frame's, and after
    any write (a register, or memory such as the stack) gdb rebuilds its frames and selects
    the one whose identity matches the frame selected before; in code it cannot unwind,
    that can be an outer frame, whose "registers" are slots on the stack: values written
    there (a stack pointer, a program counter) never reached the thread, and it crashed. So
    the innermost frame is selected first, for every read and write."""
    gdb.newest_frame().select()
    gdb.execute(f"set ${name} = {value}", to_string=True)


def in_syscall() -> bool:
    pc = reg("pc")
    try:
        code = bytes(gdb.selected_inferior().read_memory(pc - 2, 2))
    except gdb.MemoryError:
        return False
    return reg("orig_rax") >= 0 and code == SYSCALL


def pick_thread() -> gdb.InferiorThread | None:
    for thread in sorted(gdb.selected_inferior().threads(), key=lambda t: t.num):
        thread.switch()
        if in_syscall():
            return thread
    return None


def entry_point() -> int:
    found = re.search(r"Entry point: (0x[0-9a-f]+)", gdb.execute("info files", to_string=True))
    if found is None:
        raise RuntimeError("gdb shows no entry point for the program")
    return int(found.group(1), 16)


def symbol(name: str) -> int:
    for attempt in range(2):
        try:
            return int(gdb.parse_and_eval(f"(long)&{name}"))
        except gdb.error:
            if attempt or not load_mapped_interpreter():
                break
    raise RuntimeError(f"the process has no symbol {name} (not a CPython?)")


# python3.12, libpython3.12.so.1.0: proctree.maps_python's rule (gdb's Python cannot import it)
PYTHON_IMAGE = re.compile(r"(lib)?python\d")


def load_mapped_interpreter() -> bool:
    """Read the symbols of the Python images the process maps, at their load addresses.

    To gdb, a Python started through the dynamic loader (``ld-linux python3 ...``) is the
    loader: it reads the symbols of the loader and of the shared libraries, not those of the
    interpreter, so a python binary with libpython linked in shows none. Returns whether
    any image was read."""
    pid = gdb.selected_inferior().pid
    loaded: set[str] = set()
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or int(fields[2], 16) != 0:  # the image's first mapping only
                continue
            path = fields[5].strip()
            if path in loaded or not PYTHON_IMAGE.match(os.path.basename(path)):
                continue
            if any(c.isspace() or c in "'\"\\" for c in path):
                continue  # not passed through gdb's command line
            with open(path, "rb") as image:
                header = image.read(18)
            # a position-independent image (ELF type ET_DYN) is linked at 0: its symbols
            # move by its load address; a fixed-address one (ET_EXEC) sits where linked
            pie = header[:4] == b"\x7fELF" and header[16] == 3
            base = int(fields[0].split("-")[0], 16) if pie else 0
            gdb.execute(f"add-symbol-file {path} -o {base:#x}", to_string=True)
            loaded.add(path)
    return bool(loaded)


def mmap_page(syscall_at: int, length: int) -> int:
    """An anonymous read-write mapping, made by the thread's own syscall instruction."""
    args = {"rdi": 0, "rsi": length, "rdx": PROT_RW, "r10": MAP_PRIVATE_ANON, "r8": -1, "r9": 0}
    for name, value in args.items():
        set_reg(name, value)
    set_reg("orig_rax", -1)  # not a restart of the interrupted call
    set_reg("rax", NR_MMAP)
    set_reg("pc", syscall_at)
    gdb.execute("stepi", to_string=True)
    address = reg("rax")
    if address < 0 or address % PAGE:
        raise RuntimeError(f"mmap in the process failed ({address})")
    return address


def call(
    thread: gdb.InferiorThread, stack: int, function: int, arg0: int, arg1: int, ret: int
) -> int:
    """``function(arg0, arg1)`` on a frame below ``stack``, returning to ``ret``."""
    sp = ((stack - 1024) & ~0xF) - 8  # past the red zone; 16-aligned at entry + 8
    gdb.selected_inferior().write_memory(sp, ret.to_bytes(8, "little"))
    set_reg("rsp", sp)
    set_reg("rdi", arg0)
    set_reg("rsi", arg1)
    set_reg("rax", 0)
    set_reg("orig_rax", -1)
    set_reg("pc", function)
    gdb.execute(f"tbreak *{ret}", to_string=True)
    for _ in range(MAX_STOPS):
        INTERRUPTED.clear()
        gdb.execute("continue", to_string=True)
        if INTERRUPTED:
            raise RuntimeError("interrupted while the call ran")
        if gdb.selected_thread() == thread and reg("pc") == ret:
            return reg("rax") & 0xFFFFFFFF
        thread.switch()
    raise RuntimeError("the call did not return")


def restore(thread: gdb.InferiorThread, saved: dict[str, int]) -> None:
    """The saved registers back, each into the innermost frame (``set_reg``), the program
    counter last: gdb rebuilds the frames from it, and a write made to any frame but the
    innermost lands on the stack instead (the thread was once left with its old stack
    pointer that way, and crashed)."""
    thread.switch()
    for name in SAVED:
        if name != "rip":
            set_reg(name, saved[name])
    set_reg("rip", saved["rip"])


def main() -> str:
    source = os.environ.get("MGTRACE_PAYLOAD", "").encode() + b"\0"
    arch = gdb.selected_inferior().architecture().name()
    if arch != "i386:x86-64":
        return f"failed only x86-64 processes are supported (this one is {arch})"
    gdb.execute("set scheduler-locking step", to_string=True)  # stepi moves this thread only
    thread = pick_thread()
    if thread is None:
        return "busy"
    saved = {name: reg(name) for name in SAVED}
    try:
        ret = entry_point()
        # Py_AddPendingCall before the interpreter is up crashes the process: a process met
        # while it starts (importing site, say) is left as it was and tried again later
        if call(thread, saved["rsp"], symbol("Py_IsInitialized"), 0, 0, ret) == 0:
            return "starting"
        add, run = symbol("Py_AddPendingCall"), symbol("PyRun_SimpleString")
        page = mmap_page(saved["rip"] - 2, -(-len(source) // PAGE) * PAGE)
        gdb.selected_inferior().write_memory(page, source)
        status = call(thread, saved["rsp"], add, run, page, ret)
        return "queued" if status == 0 else f"failed Py_AddPendingCall returned {status}"
    except (RuntimeError, gdb.error) as exc:
        return f"failed {exc}"
    finally:
        restore(thread, saved)


gdb.events.stop.connect(_on_stop)
try:
    result = main()
except BaseException as exc:  # reported on stdout, never raised into gdb's batch run
    result = f"failed {type(exc).__name__}: {exc}"
print(f"mgtrace-gdb: {result}")
gdb.execute("detach", to_string=True)
