"""Building the oneDNN handlers' shared library (`onednn.py` loads it): found, stamped, compiled, remembered.

The handlers (`onednn.cc`: matmul, convolutions, pinning; `attention.cc`; `cpu_loops.cc`: our own vector loops;
`int8.cc`: int8 convolutions, for int8.py; `onednn.h`: what they share) are compiled once per source, jaxlib, oneDNN
and compiler with the host's C++ compiler (`-Wall -Werror`) into JAX_SD_KERNEL_DIR (default
~/.cache/jax-sd/kernels), against oneDNN 3.x from pip (requirements.txt: the `onednn-cpu-gomp` wheels, in this
Python's prefix) or 2.6 from Debian (`libdnnl-dev`); DNNL_ROOT names another install (`_onednn_roots`). The sources
compile as one translation unit per CPU the process has (`cpus.usable_cpus`; `units`), all at once, then one link:
each unit reads oneDNN's and XLA's headers once, which took about 2 s of each source's 5-7 s on a Zen 3 core, so on
a core pair two units of two sources built in 8.5 s where four of one took 12 s (a Space's cold start waits for it). A build past JAX_SD_KERNEL_BUILD_TIMEOUT (all of it, compiles and link) is stopped, and a failed one is
remembered beside the library, not retried at every start.

May import: `engine.cpus`.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax

from .. import cpus

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("onednn.cc", "kept.cc", "attention.cc", "attention_amx.cc", "cpu_loops.cc", "int8.cc")
)  # one library
HEADERS = tuple(Path(__file__).with_name(name) for name in ("onednn.h", "cpu_loops.h", "attention_amx.h"))


def _onednn_roots() -> list[Path]:
    """Where a oneDNN install is looked for, in order: DNNL_ROOT alone where set; else this Python's prefix and the
    user's (pip's `onednn-cpu-gomp` and `onednn-devel-cpu-gomp` wheels, which requirements.txt installs, put
    lib/libdnnl.so and include/oneapi/dnnl there), then /usr/local and /usr (Debian's libdnnl-dev: oneDNN 2.6).
    The environment's own install comes before the system's: it is the one this project's requirements chose
    (oneDNN 3.x), and a venv is where a newer one is put without touching the system."""
    given = os.environ.get("DNNL_ROOT")
    if given:
        return [Path(given)]
    prefixes = [Path(sys.prefix), Path(site.getuserbase()), Path("/usr/local"), Path("/usr")]
    return list(dict.fromkeys(prefixes))


def find_onednn() -> tuple[Path, Path] | None:
    """(include dir, lib dir) of a oneDNN install with its C++ header and shared library."""
    for root in _onednn_roots():
        include = root / "include"
        if not (include / "oneapi" / "dnnl" / "dnnl.hpp").is_file():
            continue
        for lib in (root / "lib", root / "lib64", root / "lib" / f"{platform.machine()}-linux-gnu"):
            if (lib / "libdnnl.so").exists():
                return include, lib
    return None


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def onednn_version(include: Path) -> str:
    """The oneDNN version an install's headers declare ("3.2.0"), or "" where they do not say."""
    try:
        text = (include / "oneapi" / "dnnl" / "dnnl_version.h").read_text()
    except OSError:
        return ""
    found = dict(re.findall(r"#define DNNL_VERSION_(MAJOR|MINOR|PATCH) (\d+)", text))
    return ".".join(found[part] for part in ("MAJOR", "MINOR", "PATCH")) if len(found) == 3 else ""


def kernel_dir() -> Path:
    return Path(os.environ.get("JAX_SD_KERNEL_DIR") or Path.home() / ".cache" / "jax-sd" / "kernels")


BUILD_TIMEOUT = "JAX_SD_KERNEL_BUILD_TIMEOUT"  # seconds the kernels' build may take (default 300)
PIP_FIX = "pip install -r requirements.txt"  # brings oneDNN 3.x (onednn-cpu-gomp, onednn-devel-cpu-gomp)
COMPILER_FIX = "apt-get install g++"  # Debian's and Ubuntu's command that brings a C++ compiler
FIX = f"{PIP_FIX} and {COMPILER_FIX}"  # what brings both, where the reason is not one of ours


class Missing(RuntimeError):
    """The kernels cannot be built here for want of `what`; `fix` is the one command that brings it."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.fix = fix


def _compile(command: list[str], compiler: str, deadline: float, timeout: float) -> str | None:
    """Runs the compiler; None when it succeeded, else why not. Past `deadline` (`time.monotonic()`; the build's
    `timeout` seconds from its start) its whole process group is killed (the driver's own children too, which would
    hold its output open); past it already, nothing is started."""
    late = f"building the oneDNN kernels took over {timeout:g} s ({BUILD_TIMEOUT})"
    if time.monotonic() >= deadline:
        return late
    try:
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        ) as proc:
            try:
                _, stderr = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                return late
    except OSError as err:
        return f"building the oneDNN kernels failed: {compiler} did not run: {err}"
    return None if proc.returncode == 0 else f"building the oneDNN kernels failed: {stderr.strip()[-2000:]}"


def units(most: int) -> list[tuple[Path, ...]]:
    """The sources grouped into `most` translation units at most (each source its own where there are enough
    CPUs), of about equal size, largest source first: once the headers are read, a unit's compile time grows with
    its code."""
    sizes = {source: len(_read(source)) for source in SOURCES}
    groups: list[list[Path]] = [[] for _ in range(max(1, min(len(SOURCES), most)))]
    for source in sorted(SOURCES, key=sizes.__getitem__, reverse=True):
        min(groups, key=lambda group: sum(map(sizes.__getitem__, group))).append(source)
    return [tuple(group) for group in groups]


def _compile_all(commands: list[list[str]], compiler: str, deadline: float, timeout: float) -> str | None:
    """`_compile` for each command, as many at once as this process has CPUs; None when all succeeded, else the
    first one's reason (in the commands' order)."""
    with ThreadPoolExecutor(max(1, min(len(commands), cpus.usable_cpus()))) as pool:
        reasons = list(pool.map(lambda command: _compile(command, compiler, deadline, timeout), commands))
    return next((reason for reason in reasons if reason is not None), None)


def build() -> Path:
    """The compiled handlers' shared library, built now if this source, jaxlib, oneDNN and compiler have none yet.
    Raises RuntimeError saying what is missing or why the build failed. A build that failed or ran past
    JAX_SD_KERNEL_BUILD_TIMEOUT seconds leaves a marker with its reason beside the library it would have made, and
    later calls raise that reason without building again (delete the marker to retry)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        raise RuntimeError(
            f"oneDNN kernels are built for Linux x86-64 only, not {platform.system()} {platform.machine()}"
        )
    found = find_onednn()
    if found is None:
        roots = ", ".join(str(r) for r in _onednn_roots())
        raise Missing(
            f"no oneDNN under {roots} ({PIP_FIX} brings oneDNN 3.x; Debian: apt-get install libdnnl-dev; "
            "or set DNNL_ROOT)",
            PIP_FIX,
        )
    include, lib = found
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise Missing(
            f"no C++ compiler to build the oneDNN kernels with (Debian, Ubuntu: {COMPILER_FIX})", COMPILER_FIX
        )
    import jaxlib

    # The stamp names what the library was built from and against: switching oneDNN installs (pip's 3.x,
    # Debian's 2.6, DNNL_ROOT) or upgrading one builds a library of its own.
    version = onednn_version(include) or "unknown"
    stamp = hashlib.sha256(
        b"".join(f.read_bytes() for f in SOURCES + HEADERS)
        + jaxlib.__version__.encode()
        + str(lib).encode()
        + b"".join(_read(include / "oneapi" / "dnnl" / name) for name in ("dnnl_version.h", "dnnl_config.h"))
        + compiler.encode()
    ).hexdigest()[:16]
    target = kernel_dir() / f"onednn-{version}-{stamp}.so"
    failed = target.with_suffix(".failed")  # the reason an earlier build of this stamp failed
    if target.exists():
        return target
    if failed.exists():
        raise RuntimeError(f"{failed.read_text().strip()} (an earlier start; delete {failed} to build again)")
    target.parent.mkdir(parents=True, exist_ok=True)
    timeout = float(os.environ.get(BUILD_TIMEOUT) or 300)
    # Our own code compiles without a warning; jaxlib's FFI headers (and oneDNN's, outside /usr/include) do not,
    # so they are system headers here.
    system = [f"-isystem{jax.ffi.include_dir()}"] + ([] if include == Path("/usr/include") else [f"-isystem{include}"])
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        # DT_RPATH, not RUNPATH: the loader then looks for libdnnl's own dependencies in its folder too, where a
        # wheel that brings them (Intel's `onednn`: TBB, the SYCL runtime) puts them beside it.
        flags = [compiler, "-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17", "-Wall", "-Werror", *system]
        groups = units(cpus.usable_cpus())
        objects = [Path(scratch) / f"unit{k}.o" for k in range(len(groups))]
        sources = [Path(scratch) / f"unit{k}.cc" for k in range(len(groups))]
        for source, group in zip(sources, groups, strict=True):  # a source's own includes stay beside it
            source.write_text("".join(f'#include "{member}"\n' for member in group))
        link = [
            compiler, "-fopenmp", "-shared", *map(str, objects), "-o", str(partial), f"-L{lib}",
            "-Wl,--disable-new-dtags", f"-Wl,-rpath,{lib}", "-ldnnl",
        ]  # fmt: skip
        compiles = [[*flags, "-c", str(source), "-o", str(obj)] for source, obj in zip(sources, objects, strict=True)]
        deadline = time.monotonic() + timeout
        reason = _compile_all(compiles, compiler, deadline, timeout) or _compile(link, compiler, deadline, timeout)
        if reason is not None:
            failed.write_text(reason + "\n")
            raise RuntimeError(reason)
        os.replace(partial, target)  # atomic: another process building the same file meanwhile is harmless
    return target
