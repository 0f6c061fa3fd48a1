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

WORKDIR /app
COPY requirements.txt .
RUN pip install -r requirements.txt
COPY --chown=app:app . .

USER 1000:1000
VOLUME ["/cache"]
EXPOSE 7860
# The page answers while the model is still warming up; the start period covers loading it.
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7860/', timeout=5)"]
CMD ["python", "app.py", "--host", "0.0.0.0", "--port", "7860"]
