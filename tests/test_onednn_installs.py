"""Which oneDNN the CPU kernels build against, and the instruction-set cap (engine/nn/onednn.py, bench/picture.py).

The kernels come from `pip install -r requirements.txt` alone: the finder takes this Python's own oneDNN (pip's
wheels) before the system's (Debian's libdnnl-dev), and DNNL_ROOT before both; each install builds a library of its
own, named by its version, so that switching installs never loads a library built against another. Under
ONEDNN_MAX_CPU_ISA=AVX2 the f32 and int8 kernels (and f32 attention's softmax) run in oneDNN's AVX2 class on whatever CPU runs the suite (on an
AVX-512 machine, the class it would not otherwise use), in a process of its own since oneDNN reads the cap once,
and equal XLA's f32 to f32 rounding and integer arithmetic exactly, as test_onednn.py and test_int8_compute.py ask of
the uncapped kernels; what this module takes the CPU to have follows the cap. `bench/picture.py --isa` hands each
system's process every cap (oneDNN's, OpenVINO's, XLA's, ATen's) and clears them for `native`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_int8_compute import integer_conv

from engine import cpus
from engine.nn import kernel_build, onednn

ROOT = Path(__file__).resolve().parents[1]


def _install(root: Path, version: tuple[int, int, int]) -> Path:
    """A oneDNN install as pip's wheels and Debian lay one out: its C++ header, its version header, its library."""
    headers = root / "include" / "oneapi" / "dnnl"
    headers.mkdir(parents=True)
    (headers / "dnnl.hpp").write_text("// oneDNN\n")
    major, minor, patch = version
    (headers / "dnnl_version.h").write_text(
        f"#define DNNL_VERSION_MAJOR {major}\n#define DNNL_VERSION_MINOR {minor}\n#define DNNL_VERSION_PATCH {patch}\n"
    )
    (root / "lib").mkdir()
    (root / "lib" / "libdnnl.so").write_bytes(b"")
    return root


def test_this_python_s_onednn_comes_before_the_system_s_and_dnnl_root_before_both(monkeypatch, tmp_path):
    venv, given = _install(tmp_path / "venv", (3, 2, 0)), _install(tmp_path / "given", (3, 13, 2))
    monkeypatch.delenv("DNNL_ROOT", raising=False)
    monkeypatch.setattr(kernel_build.sys, "prefix", str(venv))
    roots = kernel_build._onednn_roots()
    assert roots[0] == venv and roots.index(Path("/usr/local")) < roots.index(Path("/usr"))  # Debian's last
    assert kernel_build.find_onednn() == (venv / "include", venv / "lib")  # whatever the system has
    monkeypatch.setenv("DNNL_ROOT", str(given))
    assert kernel_build._onednn_roots() == [given]
    assert kernel_build.find_onednn() == (given / "include", given / "lib")


def test_a_missing_onednn_names_the_pip_command_that_brings_it(monkeypatch, tmp_path):
    monkeypatch.setenv("DNNL_ROOT", str(tmp_path))
    with pytest.raises(kernel_build.Missing, match="pip install -r requirements.txt") as missing:
        onednn.build()
    assert missing.value.fix == kernel_build.PIP_FIX


def test_a_missing_compiler_names_the_command_that_brings_one(monkeypatch, tmp_path):
    _install(tmp_path, (3, 2, 0))
    monkeypatch.setenv("DNNL_ROOT", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no g++, no c++
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(kernel_build.Missing, match="apt-get install g\\+\\+") as missing:
        onednn.build()
    assert missing.value.fix == kernel_build.COMPILER_FIX


def test_each_onednn_install_builds_a_library_of_its_own_named_by_its_version(monkeypatch, tmp_path):
    installs = {
        version: _install(tmp_path / ".".join(map(str, version)), version) for version in [(2, 6, 3), (3, 2, 0)]
    }
    compiler = tmp_path / "fake-c++"  # writes the library it is asked for, and logs each start
    compiler.write_text(
        f'#!/bin/sh\necho started >> {tmp_path}/starts\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && touch "$2"; shift; done\n'
    )
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("JAX_SD_KERNEL_DIR", str(tmp_path / "kernels"))
    built = {}
    for version, root in installs.items():
        monkeypatch.setenv("DNNL_ROOT", str(root))
        built[version] = onednn.build()
    assert built[(2, 6, 3)].name.startswith("onednn-2.6.3-") and built[(3, 2, 0)].name.startswith("onednn-3.2.0-")
    monkeypatch.setenv("DNNL_ROOT", str(installs[(2, 6, 3)]))  # back to the first: its library is there already
    assert onednn.build() == built[(2, 6, 3)]
    # two builds, each compiling every source and linking once; the third call built nothing
    assert len((tmp_path / "starts").read_text().splitlines()) == 2 * (len(kernel_build.units(cpus.usable_cpus())) + 1)


ZEN_4 = {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}


@pytest.mark.parametrize(
    "variable, cap, isa",
    [
        (None, None, "avx512_bf16"),
        ("ONEDNN_MAX_CPU_ISA", "AVX2", "avx2"),
        ("ONEDNN_MAX_CPU_ISA", "avx512_core", "avx512f"),
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", "avx512_bf16"),
        ("ONEDNN_MAX_CPU_ISA", "ALL", "avx512_bf16"),
        ("DNNL_MAX_CPU_ISA", "AVX2", "avx2"),  # oneDNN's older name for the same cap
        ("ONEDNN_MAX_CPU_ISA", "SSE41", ""),
    ],
)
def test_the_cap_narrows_what_the_cpu_is_taken_to_have(monkeypatch, variable, cap, isa):
    monkeypatch.setattr(onednn, "cpu_flags", lambda: ZEN_4)
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    if variable:
        monkeypatch.setenv(variable, cap)
    assert onednn.vector_isa() == isa
    assert onednn.native_bf16() == (isa == "avx512_bf16")  # capped below it, bf16 is not native: no bf16 kernels


CAPPED = """
import sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from engine.nn import int8, layers, onednn

assert onednn.registered(), "the kernels did not load under the cap"
onednn.handlers().OnednnEffectiveIsa.restype = __import__("ctypes").c_int64
conv = layers.conv(32, 24, 3, nnx.Rngs(0), stride=1, padding=1)
linear = layers.linear(48, 40, nnx.Rngs(0))
x, tokens = jax.random.normal(jax.random.key(1), (2, 9, 11, 32)), jax.random.normal(jax.random.key(2), (2, 7, 48))
conv_program, linear_program = jax.jit(lambda x: conv(x)), jax.jit(lambda x: linear(x))
assert onednn.CONV in conv_program.lower(x).as_text() and onednn.MATMUL in linear_program.lower(tokens).as_text()
rng = np.random.default_rng(0)
q = rng.integers(0, 256, (1, 10, 12, 40)).astype(np.uint8)
values = rng.integers(-63, 64, (3, 3, 40, 24)).astype(np.int8)
q[0, :3, :3], values[..., 0], values[..., 1] = 255, 63, -63  # the extremes of vpmaddubsw's pair sums
sums = jnp.asarray(values.astype(np.int32).reshape(-1, 24).sum(0))
np.savez(
    sys.argv[1], isa=onednn.handlers().OnednnEffectiveIsa(), vector_isa=onednn.vector_isa(),
    x=x, conv_kernel=conv.kernel[...], conv_bias=conv.bias[...], conv=conv_program(x),
    tokens=tokens, linear_kernel=linear.kernel[...], linear_bias=linear.bias[...], linear=linear_program(tokens),
    q=q, values=values, int8=jax.jit(lambda q, v: int8.int_conv(q, v, sums, (1, 1)))(q, values),
    attention_qkv=np.stack([rng.normal(size=(2, 45, 3, 16)).astype(np.float32) * 3 for _ in range(3)]),
)
qkv = np.load(sys.argv[1])["attention_qkv"]
np.savez(sys.argv[1], **np.load(sys.argv[1]), attention=onednn.attention(*(jnp.asarray(a) for a in qkv)))
"""


def _built_or_skip_here() -> None:
    """Builds the library here, so that a capped process only loads it; skips (or under JAX_SD_TEST_ONEDNN=required
    fails) where it cannot be built."""
    try:
        onednn.build()
    except RuntimeError as err:
        if os.environ.get("JAX_SD_TEST_ONEDNN") == "required":
            pytest.fail(str(err))
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    """What the f32 and int8 kernels computed in a process run under ONEDNN_MAX_CPU_ISA=AVX2 (and XLA's AVX2 cap),
    with f32 layers sent to oneDNN (JAX_SD_ONEDNN=1): the library is built here first, so that it only loads there."""
    if "avx2" not in onednn.cpu_flags():
        pytest.skip("this CPU has no AVX2: there is no AVX2 class to cap it to")
    _built_or_skip_here()
    out = tmp_path_factory.mktemp("capped") / "capped.npz"
    flags = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_cpu_max_isa=AVX2"]).strip()
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "JAX_SD_ONEDNN": "1", "XLA_FLAGS": flags}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", CAPPED, str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(out))


def test_under_the_avx2_cap_onednn_runs_its_avx2_kernels(capped):
    assert int(capped["isa"]) == 0x7  # dnnl_cpu_isa_avx2, in oneDNN 2.x and 3.x alike: nothing wider
    assert str(capped["vector_isa"]) == "avx2"


def test_under_the_avx2_cap_an_f32_conv_and_linear_equal_xla_s(capped):
    want = jax.lax.conv_general_dilated(
        capped["x"], capped["conv_kernel"], (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC"),
        precision=jax.lax.Precision.HIGHEST,
    ) + capped["conv_bias"]  # fmt: skip
    np.testing.assert_allclose(capped["conv"], want, rtol=1e-5, atol=1e-5)  # f32 sums in another order
    want = jnp.matmul(capped["tokens"], capped["linear_kernel"], precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(capped["linear"], want + capped["linear_bias"], rtol=1e-5, atol=1e-5)


def test_under_the_avx2_cap_the_int8_sums_equal_integer_arithmetic(capped):
    want = integer_conv(capped["q"], capped["values"], 1)
    assert capped["int8"].dtype == np.int32
    np.testing.assert_array_equal(capped["int8"], want)
    assert want[0, 0, 0, 0] == 255 * 63 * 9 * 40  # the corner saw only extremes


def test_under_the_avx2_cap_f32_attention_and_its_avx2_softmax_equal_the_plain_formulation(capped):
    from engine.nn.attention import softmax_attention

    want = softmax_attention(*(jnp.asarray(a) for a in capped["attention_qkv"]))  # 45 keys: 5 past the last 8
    np.testing.assert_allclose(capped["attention"], want, rtol=2e-5, atol=2e-5)


BELOW_AVX2 = """
import sys
import jax.numpy as jnp, numpy as np
from engine.nn import onednn

assert onednn.registered(), "the kernels did not load under the cap"
qkv = np.stack([np.random.default_rng(1).normal(size=(2, 45, 3, 16)).astype(np.float32) * 3 for _ in range(3)])
np.savez(sys.argv[1], qkv=qkv, attention=onednn.attention(*(jnp.asarray(a) for a in qkv)))
"""


def test_below_avx2_f32_attention_takes_onednn_s_logits_and_the_plain_softmax_to_the_same_values(tmp_path):
    """ONEDNN_MAX_CPU_ISA=SSE41: neither our AVX2 logits and softmax nor oneDNN's AVX2 kernels; what a CPU without
    AVX2 would run."""
    _built_or_skip_here()
    out = tmp_path / "below.npz"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "SSE41", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", BELOW_AVX2, str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    from engine.nn.attention import softmax_attention

    got = dict(np.load(out))
    want = softmax_attention(*(jnp.asarray(a) for a in got["qkv"]))
    np.testing.assert_allclose(got["attention"], want, rtol=2e-5, atol=2e-5)


def _picture():
    spec = importlib.util.spec_from_file_location("picture", ROOT / "bench" / "picture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_caps_every_system_s_process_and_native_clears_the_caps():
    picture = _picture()
    inherited = {"PATH": "/bin", "XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_cpu_max_isa=AVX"}
    env = picture.isa_environment("avx2", {**inherited, "DNNL_MAX_CPU_ISA": "SSE41"})
    assert env["ONEDNN_MAX_CPU_ISA"] == env["OV_CPU_MAX_ISA"] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2 --xla_cpu_max_isa=AVX2"  # one cap, ours
    assert "DNNL_MAX_CPU_ISA" not in env and env["PATH"] == "/bin"
    env = picture.isa_environment("avx512_core_bf16", {})
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16" and env["XLA_FLAGS"] == "--xla_cpu_max_isa=AVX512_BF16"
    native = picture.isa_environment("native", {**inherited, "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert native == {"PATH": "/bin", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert "instruction set cap: avx2 (ONEDNN_MAX_CPU_ISA=AVX2" in picture.cpu_header("avx2")
