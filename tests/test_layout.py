"""The house rules of `engine/`, checked on the source: imports run downward only, a family is named only in
`engine/families/`, files and classes stay small, each folder says what it holds, and the web doors use only
the engine's public face."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"
# Bottom to top: a module may import its own layer and the layers before it. `errors`, `cpus` (the CPUs this
# process may use), `request_references` (reference pictures' sizes and checks), `request` and `request_fields` (each
# request field described once) are the vocabulary every layer speaks; `compat` sits beside the engine and may import
# all of it.
LAYERS = (
    "errors",
    "cpus",
    "request_references",
    "request",
    "request_fields",
    "nn",
    "models",
    "schedulers",
    "loading",
    "families",
    "sampling",
    "serving",
)
FOLDERS = ("nn", "models", "schedulers", "loading", "families", "sampling", "serving", "compat")
FAMILY_NAMES = ("sd", "sdxl", "sd-lcm", "sd3", "flux", "flux_kontext", "z-image", "flux2")
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 250


def engine_modules() -> list[Path]:
    return sorted(p for p in ENGINE.rglob("*.py") if "assets" not in p.parts)


def layer_of(path: Path) -> str:
    part = path.relative_to(ENGINE).parts[0]
    return part.removesuffix(".py")


def engine_imports(path: Path) -> set[str]:
    """The first part below `engine` of every engine module this file imports."""
    tree = ast.parse(path.read_text())
    package = list(path.relative_to(ROOT).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package[:-1]
    else:
        package = package[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = base + (node.module.split(".") if node.module else [])
                names = [module + [a.name] for a in node.names] if not node.module else [module]
            else:
                names = [node.module.split(".")] if node.module else []
            for parts in names:
                if parts[:1] == ["engine"] and len(parts) > 1:
                    found.add(parts[1])
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "engine" and len(parts) > 1:
                    found.add(parts[1])
    return found


@pytest.mark.parametrize("path", engine_modules(), ids=lambda p: str(p.relative_to(ENGINE)))
def test_imports_run_downward_only(path):
    layer = layer_of(path)
    if layer in ("__init__", "__main__", "protocol", "compat"):  # the face, its type, the command line, compat
        return
    allowed = set(LAYERS[: LAYERS.index(layer) + 1])
    upward = {name for name in engine_imports(path) if name in LAYERS and name not in allowed}
    assert not upward, f"{path.relative_to(ROOT)} ({layer}) imports upward: {sorted(upward)}"
    assert "compat" not in engine_imports(path), f"{path.relative_to(ROOT)} imports compat"


def test_nothing_in_the_engine_imports_a_web_framework_or_torch():
    for path in engine_modules():
        text = path.read_text()
        for name in ("gradio", "fastapi", "ray", "torch"):
            assert not re.search(rf"^\s*(import|from) {name}\b", text, re.M), f"{path} imports {name}"


def test_a_family_is_named_only_in_its_folder():
    pattern = re.compile("[\"'](" + "|".join(FAMILY_NAMES) + ")[\"']")
    places = [*engine_modules(), *ROOT.glob("*.py"), *(ROOT / "web").rglob("*.py"), *(ROOT / "cluster").rglob("*.py")]
    named = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in places
        if "families" not in path.relative_to(ROOT).parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not named, f"a family's name outside engine/families/: {named}"


# Besides the registry (engine/families/__init__.py), who may import a family's module: the families built on its
# parts, the readers of its single files (their key layouts are a feature of their own), and the diffusers Flax
# API (engine/compat/flax_api.py), whose pipelines are SD's and SDXL's by name
FAMILY_MODULE_USERS = {
    "sd": {"sdxl", "lcm", "single_file", "flax_api"},
    "sdxl": {"single_file", "flax_api"},
    "lcm": set(),
    "sd3": {"flux", "z_image", "flux2", "transformer_file"},
    "flux": {"flux_kontext", "transformer_file"},
    "flux_kontext": {"transformer_file"},
    "z_image": {"transformer_file"},
    "flux2": {"transformer_file"},
}


def test_a_family_is_its_own_module_and_three_lines_of_the_registry():
    """Adding a family is its module (and its networks in engine/models) plus three one-line registrations: its
    name in the registry's import line, its `FAMILY` and its `VARIANTS`. The doors reach it through the registry."""
    families = ENGINE / "families"
    modules = sorted(p.stem for p in families.glob("*.py") if re.search(r"^FAMILY = ", p.read_text(), re.M))
    assert modules == sorted(FAMILY_MODULE_USERS)
    registry = (families / "__init__.py").read_text().split('"""', 2)[2]  # below the docstring
    for module in modules:
        lines = [line.strip() for line in registry.splitlines() if re.search(rf"\b{module}\b", line)]
        lines = [line for line in lines if not line.startswith("DEFAULT_FAMILY = ")]  # SD 1.x: the default
        assert len(lines) == 3 and lines[1:] == [f"{module}.FAMILY,", f"*{module}.VARIANTS,"], (module, lines)
        assert lines[0].startswith("from . import "), (module, lines)
    places = [*engine_modules(), *ROOT.glob("*.py"), *(ROOT / "web").rglob("*.py"), *(ROOT / "cluster").rglob("*.py")]
    for path in places:
        if path == families / "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[-1] == "families":
                imported |= {a.name for a in node.names}  # from ..families import z_image
            elif isinstance(node, ast.ImportFrom) and node.level == 1 and path.parent == families:
                imported |= {node.module} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and ".families." in f".{node.module}.":
                imported.add(node.module.split(".")[-1])  # from engine.families.sd import ...
        for module in imported & set(modules):
            assert path.stem in FAMILY_MODULE_USERS[module], (
                f"{path.relative_to(ROOT)} imports the family module {module}: a family is reached through the "
                "registry (engine.families.FAMILIES, family_of)"
            )


@pytest.mark.parametrize("folder", FOLDERS)
def test_each_folder_says_what_lives_there_and_what_it_may_import(folder):
    doc = ast.get_docstring(ast.parse((ENGINE / folder / "__init__.py").read_text())) or ""
    assert len(doc) > 100 and ("may import" in doc.lower()), f"engine/{folder}/__init__.py needs its paragraph"


def test_files_and_classes_stay_small():
    paths = [*engine_modules(), *ROOT.glob("*.py"), *(ROOT / "web").rglob("*.py"), *(ROOT / "cluster").rglob("*.py")]
    big_files = [
        f"{p.relative_to(ROOT)} ({n})" for p in paths if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    ]
    big_classes = [
        f"{p.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1})"
        for p in paths
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert not big_files and not big_classes, (big_files, big_classes)


def test_the_web_doors_use_only_the_engines_face():
    web = sorted((ROOT / "web").rglob("*.py")) + [ROOT / "app.py"]
    deep = {
        f"{p.relative_to(ROOT)}: engine.{'.'.join(sorted(found))}"
        for p in web
        if (found := engine_imports(p) - {"compat"})
    }
    assert not deep, f"reaches past engine's face: {sorted(deep)}"
