"""A dialect registered in the server's table is served as the built-in ones are: its
path routes to it, its calls are recorded, and errors on its paths answer in its shape."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx2
import pytest
from tests.test_proxy_server import start

from qwengyre.proxy import server as proxy_server
from qwengyre.proxy.dialect import ErrorAnswer
from qwengyre.proxy.openai_api import OpenAIChat
from qwengyre.proxy.types import ApiError


class Echo(OpenAIChat):
    """Chat Completions' bodies on a path and in an error shape of its own."""

    name = "echo"
    call_path = "/v1/echo"
    path_marker = "/echo"

    def error(self, e: ApiError) -> ErrorAnswer:
        return ErrorAnswer(e.status, {"echo_error": e.message}, {"x-echo": e.kind})


def test_a_dialect_added_to_the_table_is_served(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(proxy_server, "DIALECTS", (*proxy_server.DIALECTS, Echo()))
    with contextlib.contextmanager(start)(tmp_path, tiny_model_dir) as proxy:
        ex = proxy.new_execution()
        url = ex["base_url"] + "/v1/echo"
        auth = {"authorization": f"Bearer {ex['key']}"}
        messages = [{"role": "user", "content": "List the files."}]

        whole = httpx2.post(url, json={"model": "tiny", "messages": messages}, headers=auth)
        assert whole.status_code == 200, whole.text
        assert whole.json()["object"] == "chat.completion"
        streamed = httpx2.post(
            url, json={"model": "tiny", "messages": messages, "stream": True}, headers=auth
        )
        assert streamed.status_code == 200
        assert streamed.text.endswith("data: [DONE]\n\n")
        assert [n["parent"] for n in proxy.tree(ex["id"])] == [None, None]

        refused = httpx2.post(url, json={"model": "tiny"}, headers=auth)
        assert refused.status_code == 400
        assert refused.headers["x-echo"] == "invalid_request_error"
        assert "messages" in refused.json()["echo_error"]
        stranger = httpx2.post(url, json={"model": "tiny", "messages": messages})
        assert stranger.status_code == 401 and "echo_error" in stranger.json()
        nowhere = httpx2.get(proxy.url + "/v1/echo/nothing")  # no route under its path
        assert nowhere.status_code == 404 and "echo_error" in nowhere.json()
        assert len(proxy.tree(ex["id"])) == 2  # nothing recorded for a refused call
