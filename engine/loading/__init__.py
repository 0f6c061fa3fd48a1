"""Reading what people publish: model sources (folders, the Hub, the embedded default), safetensors memory-mapped
and converted strictly into our layout, PyTorch pickles read without running them, the original (LDM) layout's
tensor names renamed to diffusers' (and FLUX.1's and MMDiT's transformers', `dit_keys.py`), GGUF files read and
dequantized (`gguf_file.py`), tokenizers (CLIP's, T5's, and Qwen's with its chat template:
`qwen_tokenizer.py`), VAEs (tiny ones also in madebyollin/taesd's own files: `taesd_files.py`), ControlNets, LoRAs (every key layout), safety checkers, and upscaler networks told
from their keys (`upscaler.py`) with the folder of them a server offers (`upscaler_folder.py`), textual
inversion embeddings (`embeddings.py`) appended to the text encoders' token tables (`textual_inversion.py`), and a
models folder in A1111's layout with its checkpoints' names (`models_folder.py`).

Nothing here knows a model family: a folder is components with configs and tensors; `engine/families/` says what
a family's folder must hold and builds it.

May import: `engine.models`, `engine.nn`, `engine.errors`, huggingface_hub, safetensors, gguf, transformers' tokenizers,
jinja2 (a tokenizer's chat template).
"""
