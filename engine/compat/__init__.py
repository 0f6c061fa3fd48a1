"""Beside the engine, for other people's code: diffusers' deleted Flax pipelines and schedulers kept alive on our
models (`flax_api.py`, `flax_api_schedulers.py`), and AUTOMATIC1111's PNG "parameters" text (`pnginfo.py`).

May import any part of the engine; nothing in the engine imports it.
"""
