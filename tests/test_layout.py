"""The lab stays apart: what ships to workers (echo2/ outside echo2/lab, and the configs a run composes) never
imports the lab tools; tests, benchmarks and launchers may."""

from __future__ import annotations

import ast

from conftest import CONF, ROOT


def _imports(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update([node.module] + [f"{node.module}.{a.name}" for a in node.names])
    return names


def test_no_library_module_imports_the_lab():
    library = [p for p in (ROOT / "echo2").rglob("*.py") if p.relative_to(ROOT / "echo2").parts[0] != "lab"]
    assert len(library) > 20 and (ROOT / "echo2" / "broadcast" / "relay.py") in library
    hits = sorted(f"{p.relative_to(ROOT)}: {name}" for p in library for name in _imports(p)
                  if name == "echo2.lab" or name.startswith("echo2.lab."))
    assert hits == []
    targets = [f"{p.relative_to(ROOT)}" for p in CONF.rglob("*.yaml") if "echo2.lab" in p.read_text()]
    assert targets == []


def test_the_check_sees_an_import_of_the_lab(tmp_path):
    """The check above can fail: each spelling of an import of the lab is seen."""
    for line in ("import echo2.lab.link", "from echo2.lab import link", "from echo2 import lab",
                 "def f():\n    from echo2.lab.link import Link"):
        src = tmp_path / "m.py"
        src.write_text(line + "\n")
        assert any(n == "echo2.lab" or n.startswith("echo2.lab.") for n in _imports(src)), line
