"""A static read of the submission for a TA: constructs worth a look, which change no score.

The broker and the sandbox are what stop a submission from cheating; this
list only points a human at code that tried something unusual (loading C
libraries, running strings as code, reaching into torch's internals,
opening sockets or shared memory). It parses the source with :mod:`ast` in
the grader's process and never runs it.
"""

from __future__ import annotations

import ast
from pathlib import Path

_MODULES = {
    "ctypes": "loads C code (ctypes)",
    "cffi": "loads C code (cffi)",
    "importlib": "imports by computed name (importlib)",
    "socket": "opens network sockets",
    "multiprocessing": "starts or shares with other processes (multiprocessing)",
    "subprocess": "starts other programs",
    "mmap": "maps memory (mmap)",
    "pickle": "unpickles data",
    "inspect": "inspects the grader's frames (inspect)",
    "gc": "walks the interpreter's objects (gc)",
}
_CALLS = {
    "exec": "runs a string as code (exec)",
    "eval": "runs a string as code (eval)",
    "compile": "compiles a string as code",
    "__import__": "imports by computed name (__import__)",
    "setattr": "sets attributes by computed name (setattr)",
    "_getframe": "reads the caller's frames (sys._getframe)",
    "fork": "forks the process",
    "setsid": "starts a new session (daemon)",
    "_exit": "ends the process (os._exit)",
}
_ATTRIBUTES = {
    "_C": "reaches into torch's C internals (torch._C)",
    "ops": "calls torch operators directly (torch.ops)",
    "_functional_collectives": "uses torch's functional collectives",
    "SharedMemory": "uses shared memory",
    "shared_memory": "uses shared memory",
    "_store": "reaches the process group's store",
}


def audit(directory: Path) -> list[str]:
    """'assignments/file.py:line: what it does' for every construct worth a look."""
    findings: list[str] = []
    for path in sorted(directory.rglob("*.py")):
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, OSError):
            continue
        where = f"assignments/{path.relative_to(directory)}"
        for node in ast.walk(tree):
            reason = _reason(node)
            if reason:
                findings.append(f"{where}:{getattr(node, 'lineno', '?')}: {reason}")
    return list(dict.fromkeys(findings))[:100]


def _reason(node: ast.AST) -> str:
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] in _MODULES:
                return _MODULES[alias.name.split(".")[0]]
    if isinstance(node, ast.ImportFrom) and node.module:
        if node.module.split(".")[0] in _MODULES:
            return _MODULES[node.module.split(".")[0]]
        if "_functional_collectives" in node.module or node.module.startswith("torch._C"):
            return _ATTRIBUTES["_C" if "_C" in node.module else "_functional_collectives"]
    if isinstance(node, ast.Call):
        name = (
            node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        )
        if name in _CALLS:
            return _CALLS[name]
        if name == "getattr" and len(node.args) >= 2 and not isinstance(node.args[1], ast.Constant):
            return "reads attributes by computed name (getattr)"
    if isinstance(node, ast.Attribute) and node.attr in _ATTRIBUTES:
        return _ATTRIBUTES[node.attr]
    return ""
