"""The repository as a Hugging Face Space, a page behind a log-in, the MCP tool, and a quiet start-up."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import app
from tests._app_server import ROOT, AppServer, shared_app


def test_the_readme_front_matter_makes_a_gradio_space_that_matches_the_requirements():
    from huggingface_hub.repocard import metadata_load

    meta = metadata_load(ROOT / "README.md")
    assert meta["sdk"] == "gradio"
    assert (ROOT / meta["app_file"]).is_file()
    lines = (re.sub(r"\s+#.*", "", line).strip() for line in (ROOT / "requirements.txt").read_text().splitlines())
    pinned = {Requirement(line).name: Requirement(line) for line in lines if line and not line.startswith(("#", "-"))}
    assert pinned["gradio"].specifier.contains(meta["sdk_version"]), (meta["sdk_version"], pinned["gradio"])
    import gradio

    assert gradio.__version__ == meta["sdk_version"], "the Space runs the Gradio version the tests ran"
    python = meta["python_version"]
    assert re.fullmatch(r"3\.\d+", python)
    assert f"python-version: '{python}'" in (ROOT / ".ci" / "run").read_text() or sys.version.startswith(python)


@pytest.mark.parametrize(
    ("value", "pairs"),
    [
        (None, None),
        ("ann:secret", [("ann", "secret")]),
        ("ann:secret, bob:pa:ss", [("ann", "secret"), ("bob", "pa:ss")]),
    ],
)
def test_auth_takes_pairs(value, pairs):
    assert app.read_auth(value) == pairs


def test_auth_reads_a_file_of_pairs(tmp_path):
    path = tmp_path / "users.txt"
    path.write_text("# invited\nann:secret\n\nbob:hunter2\n")
    assert app.read_auth(str(path)) == [("ann", "secret"), ("bob", "hunter2")]
    with pytest.raises(ValueError, match="'nobody' is not user:password"):
        app.read_auth("nobody")


def test_transformers_advice_is_silenced_by_the_app():
    # Without PyTorch (the app's own install), transformers advises installing it on import.
    code = "import app, transformers.utils.logging as l; l.get_logger('probe').warning_advice('ADVICE')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ADVICE" not in done.stderr


@pytest.mark.slow
def test_start_up_prints_no_alarming_noise(request, tmp_path_factory):
    log = shared_app(request, tmp_path_factory).log_tail(20_000)
    for noise in ("Unable to initialize backend", "PyTorch was not found", "HTTP Request:"):
        assert noise not in log, log


@pytest.mark.slow
def test_a_page_behind_a_login_refuses_strangers_and_serves_users_and_mcp(tmp_path):
    from gradio_client import Client

    server = AppServer(tmp_path, "--auth", "ann:secret", "--mcp").wait_until_up()
    try:
        with pytest.raises(Exception, match=r"(?i)login|auth|401|403|credentials"):
            Client(server.url, verbose=False)
        client = Client(server.url, auth=("ann", "secret"), verbose=False, download_files=str(tmp_path / "dl"))
        gallery, seed, _ = client.predict(prompt="a red circle", seed=3, random_seed=False, api_name="/generate")
        assert seed == 3 and gallery[0]["caption"].endswith("seed 3")
        # The MCP server lists the generate tool to a user who sends the login as HTTP Basic, as MCP clients do, and
        # to nobody else; its parameters are described from the handler's docstring.
        schema_url = server.url + "gradio_api/mcp/schema"
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(schema_url, timeout=30)
        login = "Basic " + base64.b64encode(b"ann:secret").decode()
        request = urllib.request.Request(schema_url, headers={"Authorization": login})
        schema = json.loads(urllib.request.urlopen(request, timeout=30).read())
        tools = {tool["name"]: tool for tool in schema}
        tool = next(tool for name, tool in tools.items() if name.endswith("generate"))
        assert "Stable Diffusion" in tool["description"]
        assert "prompt" in json.dumps(tool["inputSchema"])
    finally:
        server.stop()


def test_the_page_says_where_to_find_the_space_settings():
    assert Path(ROOT / "README.md").read_text().startswith("---\ntitle: jax-sd\n")
