# jax-sd web demo on CPU: docker build -t jax-sd . && docker run -p 7860:7860 -v jax-sd-cache:/cache jax-sd
FROM python:3.11-slim

# The Hub download cache and JAX's compilation cache live on the /cache volume, so a new
# container neither downloads the model again nor recompiles it.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/cache/huggingface \
    JAX_SD_CACHE_DIR=/cache/xla \
    GRADIO_ANALYTICS_ENABLED=False \
    GRADIO_SERVER_PORT=7860

RUN useradd --create-home --uid 1000 app \
    && mkdir -p /cache/huggingface /cache/xla \
    && chown -R app:app /cache

# oneDNN and a C++ compiler: on a CPU with native bf16 the networks run in bf16 through oneDNN's kernels
# (engine/nn/onednn.py), built below into the image; elsewhere the app runs in f32 without them.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++=4:12.2.0-3 libdnnl-dev=2.6.3-1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY requirements.txt constraints.txt ./
RUN pip install -r requirements.txt
COPY --chown=app:app . .
ENV JAX_SD_KERNEL_DIR=/app/kernels
RUN python -c "from engine.nn import onednn; print(onednn.build())" && chown -R app:app /app/kernels

USER 1000:1000
VOLUME ["/cache"]
EXPOSE 7860
# The page answers while the model is still warming up; the start period covers loading it.
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7860/', timeout=5)"]
CMD ["python", "app.py", "--host", "0.0.0.0", "--port", "7860"]
