"""A vLLM server as a cell's rollout server (``engine.backend=vllm``; issue 18).

:class:`VLLMHost` is a :class:`~qwengyre.cluster.server_host.ServerHost` that launches
``python -m vllm.entrypoints.openai.api_server`` (the interpreter of
``$QWENGYRE_VLLM_PYTHON``: vLLM usually needs its own environment; tensor parallel
over the cell's GPUs, ``--tensor-parallel-size``), and the proxy drives it with
:class:`~qwengyre.engines.vllm.VLLMEngine`.

Weights come through disk (the base host's model directories), loaded in place
(:meth:`~qwengyre.engines.vllm.VLLMEngine.update_weights`: in-flight requests continue,
each token keeps the version that produced it). A server started from a published
version labels its weights with it (vLLM says ``default`` otherwise).

Role switches: on a GPU, ``release`` puts the server to sleep (its weights and KV
cache leave the device; ``--enable-sleep-mode``) and ``resume`` wakes it. On the CPU
vLLM's sleep frees nothing, so the server is stopped and started again from the
newest weights directory.
"""

from __future__ import annotations

import subprocess
from typing import Any

from qwengyre.cluster.server_host import ServerHost
from qwengyre.engines.vllm import VLLMEngine, VLLMServerSpec, launch_vllm

__all__ = ["VLLMHost"]


class VLLMHost(ServerHost[VLLMEngine]):
    """One vLLM server for a cell or the standalone pool; see the module docstring."""

    api = "vllm"

    def server_spec(self, model: str | None = None) -> VLLMServerSpec:
        """How the server starts, on the weights in ``model`` (default: the base model)."""
        cpu = self.device == "cpu"
        return VLLMServerSpec(
            model=model or str(self.model_dir),
            host=self.host,
            port=self.port,
            api_key=self.api_key,
            dtype="float32" if cpu else "auto",
            max_model_len=self.max_context,
            extra_args=(
                "--tensor-parallel-size",
                str(self.tp_size),
                # CPU: skip a long graph compile; GPU: without it /sleep frees nothing.
                "--enforce-eager" if cpu else "--enable-sleep-mode",
            ),
            extra_env={**self.gpu_env(), **({"VLLM_CPU_KVCACHE_SPACE": "1"} if cpu else {})},
        )

    def _popen(self, model: str, **popen_kwargs: Any) -> subprocess.Popen[bytes]:
        return launch_vllm(self.server_spec(model), **popen_kwargs)

    def _new_client(self) -> VLLMEngine:
        return VLLMEngine(
            self.url, self.name, capacity=1, api_key=self.api_key, policy_version=self.version
        )

    async def _ready(self, client: VLLMEngine, process: subprocess.Popen[bytes]) -> None:
        await super()._ready(client, process)
        if self.version >= 0:  # started from a published version: say which
            await client.label_weights(self.version)

    def _free(self, timeout_s: float) -> str:
        if self.device == "cpu":  # vLLM's sleep frees nothing on the CPU
            self._stop()
            return "stopped"
        return super()._free(timeout_s)
