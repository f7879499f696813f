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


# ---------------------------------------------------------------------- the house by process

PLANES = ("learner", "coordinator", "worker")
"""The code of each process: the learner (learner/, its rollout sources in learner/sources/), the coordinator process
(coordinator/) and the worker host (worker/)."""

SHARED = ("net", "broadcast", "models", "tasks", "activation", "records", "seams", "settings", "scoring", "metrics",
          "env", "capacity", "credential", "trackers")
"""What the processes share (each plane may import these, and they import no plane)."""

TOOL_IMPORTS = {"echo2/config.py": {"echo2.coordinator.broadcaster", "echo2.coordinator.broadcaster.RelayBroadcaster"}}
"""The imports of a plane by a tool that the learner process runs: train.py composes its config with echo2/config.py,
which reads the coordinator's broadcaster constructor as the ``broadcast.sender`` schema (its class, no instance)."""

TOOLS = ("lab", "sim", "cost", "plan", "report", "config", "config_checks", "config_reference", "eval", "export")
"""What wires the planes or studies them from outside (like train.py, tests and benchmarks): may import any."""


def _plane(module: str) -> str | None:
    """The plane an ``echo2.x.y`` module belongs to; "tool" for TOOLS; None for what every plane shares."""
    parts = module.split(".")
    if parts[0] != "echo2" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in PLANES else "tool" if parts[1] in TOOLS else None


def sideways_imports(root) -> list[str]:
    """Each import by a plane's module of another plane, and by a shared module of any plane or tool."""
    hits = []
    for path in sorted((root / "echo2").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        own = _plane(module)
        if own == "tool":
            continue
        for name in _imports(path):
            other = _plane(name)
            if other is not None and other != own:
                hits.append(f"{path.relative_to(root)} ({own or 'shared'}) imports {name} ({other})")
    return hits


def test_no_plane_imports_another_and_shared_modules_import_no_plane():
    """A plane imports shared modules and seams only: the learner's code never reaches into the coordinator's or a
    worker's, and what they share (records, seams, settings, scoring, the snapshot format and relay, transport,
    models, tasks) imports none of them."""
    assert {p.name for p in (ROOT / "echo2").iterdir() if p.is_dir()} >= set(PLANES)
    assert sideways_imports(ROOT) == []


def test_every_module_has_a_known_room_and_the_learner_process_imports_the_coordinator_only_where_named():
    """Every top-level name under echo2/ is a plane, a shared module or a tool (a new room is placed here on purpose),
    and of the tools the learner process runs (config.py, through train.py) only the named imports reach another
    process's code."""
    rooms = {p.stem for p in (ROOT / "echo2").iterdir()
             if (p.is_dir() and p.name not in ("__pycache__", "sim_inputs")) or (p.suffix == ".py" and p.stem != "__init__")}
    assert rooms - set(PLANES) - set(SHARED) - set(TOOLS) == set()
    for rel, allowed in TOOL_IMPORTS.items():
        reached = {name for name in _imports(ROOT / rel) if _plane(name) in ("coordinator", "worker")}
        assert reached == allowed, rel


def test_the_check_sees_a_sideways_import(tmp_path):
    """The check above can fail: a learner module importing the coordinator, and a shared one importing a worker
    module, are each found; a plane importing a shared module is not."""
    for rel, line, found in (("echo2/learner/x.py", "from echo2.coordinator.buffer import StalenessBuffer", True),
                             ("echo2/records.py", "def f():\n    import echo2.worker.agent", True),
                             ("echo2/learner/sources/x.py", "from echo2.coordinator import schemas", True),
                             ("echo2/worker/x.py", "from echo2.broadcast import snapshot", False),
                             ("echo2/coordinator/x.py", "from echo2.seams import Broadcaster", False)):
        root = tmp_path / rel.replace("/", "_")
        src = root / rel
        src.parent.mkdir(parents=True)
        src.write_text(line + "\n")
        assert bool(sideways_imports(root)) == found, (rel, line)
