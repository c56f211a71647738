"""The package floors: a package imports only packages on floors below its own, and two packages
sharing a floor do not import each other (so there is no circle, not even through an import inside
a function). Read from the source with `ast`, every import statement counted. The packages are
megajax's subpackages and top-level modules, and the repository's `pallas_kernels` (the kernels
megajax imports where it uses them)."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / "megajax"
KERNELS = "pallas_kernels"  # a top-level package beside megajax

# Top to bottom; each entry is one floor.
FLOORS = [
    ("cli",),
    ("perf",),
    ("train", "inference"),
    ("checkpoint", "parallel"),
    ("models",),
    ("plan",),
    ("precision", "mesh", "distributed", "compile_cache"),
    ("data",),
    ("config",),
    ("megatron_args", "paths"),
    ("pallas_kernels", "errors", "host_allocator", "megatron_rules", "xla_env"),
]
LEVEL = {package: i for i, floor in enumerate(FLOORS) for package in floor}


def package_of(path: Path) -> str:
    """megajax/train/loop.py -> train; megajax/plan.py -> plan; pallas_kernels/x.py -> pallas_kernels."""
    if ROOT not in path.parents:
        return KERNELS
    return path.relative_to(ROOT).with_suffix("").parts[0]


def package_imported(name: str) -> str | None:
    """megajax.train.loop -> train; pallas_kernels.fp8_linear -> pallas_kernels; jax -> None."""
    parts = name.split(".")
    if parts[0] == KERNELS:
        return KERNELS
    return parts[1] if parts[0] == "megajax" and len(parts) > 1 else None


def megajax_imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported package) of every import statement in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "megajax" else [f"megajax.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom):  # relative: resolved against the file's package
            raise AssertionError(f"{path}:{node.lineno}: relative import; megajax spells imports absolutely")
        else:
            continue
        out += [(node.lineno, p) for p in map(package_imported, names) if p is not None]
    return out


def violations() -> list[str]:
    out = []
    for path in sorted([*ROOT.rglob("*.py"), *(ROOT.parent / KERNELS).rglob("*.py")]):
        if path == ROOT / "__init__.py":
            continue
        here = package_of(path)
        assert here in LEVEL, f"{path}: package {here!r} is on no floor of tests/test_imports.py"
        for line, there in megajax_imports(path):
            if there == here:
                continue
            where = f"{path.relative_to(ROOT.parent)}:{line}"
            if there not in LEVEL:
                out.append(f"{where}: {here} imports megajax.{there}, which is on no floor")
            elif LEVEL[there] < LEVEL[here]:
                out.append(f"{where}: {here} imports {there}, a floor above it")
            elif LEVEL[there] == LEVEL[here]:
                out.append(f"{where}: {here} imports {there}, beside it on the same floor")
    return out


def test_every_package_imports_only_lower_floors():
    found = violations()
    assert not found, "\n".join(found)


def test_the_checker_sees_imports_inside_functions(tmp_path, monkeypatch):
    """A function-local import of a higher floor is found (the check is not only module level)."""
    pkg = tmp_path / "megajax"
    (pkg / "data").mkdir(parents=True)
    (pkg / "data" / "x.py").write_text("def f():\n    from megajax.train.loop import train\n    return train\n")
    (pkg / "mesh.py").write_text("import megajax.config\nfrom megajax import errors\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    assert violations() == ["megajax/data/x.py:2: data imports train, a floor above it"]


@pytest.mark.parametrize("package", sorted(LEVEL))
def test_every_floor_package_exists(package):
    where = REPO if package == KERNELS else ROOT
    assert (where / package).is_dir() or (where / f"{package}.py").is_file(), package
