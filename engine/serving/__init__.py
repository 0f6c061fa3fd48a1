"""Serving many users at once: the `Engine` (a loaded model on a device mesh, the public face's main object),
requests turned into plans and jobs (`jobs.py`), the batcher thread that runs every request's slots in shared
batches (`batcher.py`), the compiled programs per plan and width (`programs.py`), warm-up (`warmup.py`),
`load_pipeline` and `load_models` (`start.py`), tickets (`ticket.py`), hires fix's two passes (`hires.py`), A1111's
image-to-image preparation around a request (`prepared.py`), per-batch LoRA weights (`lora_serving.py`),
and several models served at once within a budget (`model_pool.py`, a models folder's LoRAs: `folder_loras.py`).

May import everything below it: `engine.sampling`, `engine.families`, `engine.loading`, `engine.schedulers`,
`engine.models`, `engine.errors`, `engine.request`. Never gradio, FastAPI or Ray.
"""
