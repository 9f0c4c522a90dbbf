"""Nothing outside tests can turn bytes into objects by unpickling (RELIABILITY.md, Security).

The scan parses every ``*.py`` file of the repository except ``tests/`` and looks at code, not
text: the words in a comment or docstring ("never pickle") are fine; an import of ``pickle``,
a call of ``torch.load`` or ``marshal.loads`` is not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("router", "stage_worker", "kvcache", "kernels", "gateway", "stagemesh")
_SKIP_DIRS = {"tests", "node_modules", "build", "dist", "__pycache__"}

# Modules whose whole purpose is (de)serialising arbitrary objects.
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve"}
# Calls that unpickle or unmarshal, by dotted name as written.
FORBIDDEN_CALLS = {"torch.load", "torch.serialization.load", "marshal.loads", "marshal.load"}
# `from X import Y` forms of the same calls.
FORBIDDEN_FROM_IMPORTS = {("torch", "load"), ("torch.serialization", "load"),
                          ("marshal", "loads"), ("marshal", "load")}


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _root(module: str) -> str:
    return module.split(".")[0]


def find_unpickling(source: str, filename: str = "<source>") -> list[str]:
    """Every forbidden use in ``source``, as ``file:line: what``."""
    hits: list[str] = []

    def hit(node: ast.AST, what: str) -> None:
        hits.append(f"{filename}:{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _root(alias.name) in FORBIDDEN_MODULES:
                    hit(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if _root(node.module) in FORBIDDEN_MODULES:
                hit(node, f"from {node.module} import ...")
            for alias in node.names:
                if (node.module, alias.name) in FORBIDDEN_FROM_IMPORTS:
                    hit(node, f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute):
            name = _dotted(node)
            if name in FORBIDDEN_CALLS:
                hit(node, name)
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_MODULES:
            hit(node, f"name {node.id}")
        elif isinstance(node, ast.Call):
            hits.extend(_call_hits(node, filename))
    return hits


def _call_hits(call: ast.Call, filename: str) -> list[str]:
    """``np.load(..., allow_pickle=True)`` and dynamic imports of forbidden modules."""
    out = []
    for kw in call.keywords:
        if kw.arg == "allow_pickle" and not (
            isinstance(kw.value, ast.Constant) and kw.value.value is False
        ):
            out.append(f"{filename}:{call.lineno}: allow_pickle")
    name = _dotted(call.func)
    if name in {"__import__", "importlib.import_module", "import_module"} and call.args:
        arg = call.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and (
            _root(arg.value) in FORBIDDEN_MODULES or arg.value == "marshal"
        ):
            out.append(f"{filename}:{call.lineno}: dynamic import of {arg.value}")
    return out


def scanned_files() -> list[Path]:
    """Every ``*.py`` under the repository root except tests, virtualenvs and build output."""
    files = []
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO).parts
        if any(p in _SKIP_DIRS or p.startswith(".") or p.endswith(".egg-info") for p in rel[:-1]):
            continue
        files.append(path)
    return files


def test_no_unpickling_outside_tests() -> None:
    files = scanned_files()
    scanned_packages = {f.relative_to(REPO).parts[0] for f in files}
    missing = [p for p in PACKAGES if (REPO / p).is_dir() and p not in scanned_packages]
    assert not missing, f"scan skipped packages {missing}"
    assert {"stage_worker", "router"} <= scanned_packages  # the scan is not vacuous
    hits = [h for f in files for h in find_unpickling(f.read_text(encoding="utf-8"),
                                                       str(f.relative_to(REPO)))]
    assert not hits, "unpickling outside tests:\n" + "\n".join(hits)


@pytest.mark.parametrize("snippet", [
    "import pickle",
    "import pickle as p",
    "import cPickle",
    "import dill.settings",
    "from pickle import loads",
    "import shelve",
    "from cloudpickle import loads",
    "import torch\nx = torch.load('w.pt')",
    "import torch\nx = torch.load('w.pt', weights_only=True)",
    "from torch import load",
    "import marshal\nmarshal.loads(b'')",
    "from marshal import loads",
    "import numpy as np\nnp.load('x.npy', allow_pickle=True)",
    "import importlib\nimportlib.import_module('pickle')",
    "__import__('dill')",
])
def test_scan_catches(snippet: str) -> None:
    assert find_unpickling(snippet), snippet


@pytest.mark.parametrize("snippet", [
    '"""We never pickle; torch.load is banned."""',
    "# import pickle would be wrong here",
    "x = 'pickle'",
    "import marshal\nmarshal.dumps(1)",
    "import numpy as np\nnp.load('x.npy', allow_pickle=False)",
    "from safetensors.torch import load_file",
])
def test_scan_allows(snippet: str) -> None:
    assert find_unpickling(snippet) == [], snippet
