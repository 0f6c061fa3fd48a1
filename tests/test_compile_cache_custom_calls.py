"""The on-disk compilation cache keeps the programs that call our oneDNN handlers (engine/nn/), so a restart with the
cache kept compiles nothing: `--quantize w8a8` is what a CPU Space runs, and its UNet's every convolution and linear
layer is a custom call (`onednn.INT8_CONV`).

JAX writes a compiled program to its persistent cache only where nothing stops it (host callbacks, a minimum compile
time or entry size: `enable_compile_cache` sets both to nothing), and a later process can only load one that calls an
FFI target if the target is registered before the program is deserialized: ours are registered while the program is
traced (`onednn.registered`), which comes before JAX looks in its cache. Each side here runs in a fresh process with
the same cache folder, the embedded model's UNet in w8a8 at an 8x8 latent, and counts JAX's own cache events.
Skipped, as the other oneDNN tests are, where the kernels cannot be built here.
"""

from __future__ import annotations

import json

from jax._src.compilation_cache import decompress_executable  # zstd or zlib, as JAX wrote the entry

from engine.nn import onednn
from tests.multidevice import run_with_devices
from tests.test_int8_compute import _onednn_or_skip

DENOISE = """
    import collections, json
    import jax, numpy as np
    from flax import nnx
    events = collections.Counter()
    jax.monitoring.register_event_listener(lambda event, **_: events.update([event.rsplit("/", 1)[-1]]))
    from engine import enable_compile_cache
    from engine.families.loader import load_model_folder
    from engine.loading.quantize import computes_in_int8, quantize_params
    from engine.nn import onednn
    enable_compile_cache(OUT / "xla")
    model = load_model_folder(None, "float32")
    graphdef, params = model.graphdef, quantize_params(model.params, "unet", mode="w8a8")  # as load_pipeline does
    assert computes_in_int8(params)

    @jax.jit
    def denoise(params, x, t, context):
        return nnx.merge(graphdef, params).unet(x, t[None], context)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 8, 8, 4)).astype(np.float32)
    context = rng.standard_normal((1, 77, model.denoiser_config.cross_attention_dim)).astype(np.float32)
    eps = np.asarray(denoise(params, x, np.float32(999), context))
    print(json.dumps(dict(events, registered=onednn.registered(), eps=eps.ravel()[:16].tolist())))
    """


def test_a_restart_loads_the_w8a8_programs_with_their_custom_calls_from_the_disk_cache(tmp_path):
    _onednn_or_skip()
    first = json.loads(run_with_devices(1, DENOISE, tmp_path).splitlines()[-1])
    written = {path.name: path.stat().st_mtime_ns for path in (tmp_path / "xla").iterdir()}
    assert first["registered"] and first["cache_misses"] >= 1  # compiled, and written (no size or time minimum)
    unet = [name for name in written if name.startswith("jit_denoise-")]
    assert len(unet) == 1 and onednn.INT8_CONV.encode() in decompress_executable(
        (tmp_path / "xla" / unet[0]).read_bytes()
    )

    again = json.loads(run_with_devices(1, DENOISE, tmp_path).splitlines()[-1])
    assert again.get("cache_misses", 0) == 0  # a new process, the same cache: nothing compiled
    assert again["cache_hits"] == first["cache_misses"]  # every program loaded, the UNet's custom calls and all
    assert {path.name: path.stat().st_mtime_ns for path in (tmp_path / "xla").iterdir()} == written  # none rewritten
    assert again["eps"] == first["eps"]  # and the loaded program computes what the compiled one did
