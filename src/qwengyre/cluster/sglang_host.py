"""An SGLang server as a cell's rollout server (``engine.backend=sglang``).

:class:`SGLangHost` is a :class:`~qwengyre.cluster.server_host.ServerHost` that launches
``python -m sglang.launch_server`` (the interpreter of ``$QWENGYRE_SGLANG_PYTHON``, else
this one) with ``--tp-size`` over the cell's GPUs, ``--context-length``
(``engine.max_context``), ``--weight-version`` when it starts from a published version,
on a GPU ``--enable-memory-saver``, and ``--config`` naming a YAML file that holds its
API key (``api-key``), so that the key is not on a command line any local user can read
(``ps``). The file is written for each launch, mode 0600, in the host's private
working directory (mode 0700), which :meth:`~ServerHost.close` removes. This needs an
SGLang that reads ``--config``: sgl-project/sglang#10534 (September 2025) or later.
The proxy drives the server with :class:`~qwengyre.engines.sglang.SGLangEngine`.

Weights: on a GPU they travel as tensors, in buckets of bounded size. Each bucket is
read from the boards only when it is sent (:meth:`~qwengyre.cluster.weights.BoardShards.by_name`:
every shard's rows of the bucket's tensors, put together), so the host holds one bucket,
not the model, and goes through the host's GPU by CUDA IPC (``/update_weights_from_tensor``, see
:class:`~qwengyre.engines.sglang.TensorRoute`). The host runs on the node and the
devices of its server, so CUDA IPC always reaches it: no NCCL group between trainer and
server (``/update_weights_from_distributed``) is needed. A server that does not take
tensors (an older SGLang answers 4xx) gets its weights from disk from then on, as on the
CPU: a model directory per version (the base host's), ``/update_weights_from_disk``.

Role switches: ``release`` frees the server's weights and KV cache
(``/release_memory_occupation``; memory leaves the GPU with ``--enable-memory-saver``)
and answers ``"asleep"``; ``resume`` brings them back (``/resume_memory_occupation``)
and loads the newest weights.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path
from typing import Any

from qwengyre.cluster.server_host import ServerHost
from qwengyre.cluster.weights import BoardShards
from qwengyre.engines.sglang import (
    SGLangEngine,
    SGLangServerSpec,
    TensorRoute,
    TensorRouteUnavailable,
    launch_sglang,
    write_key_config,
)

__all__ = ["SGLangHost"]

log = logging.getLogger(__name__)


class SGLangHost(ServerHost[SGLangEngine]):
    """One SGLang server for a cell or the standalone pool; see the module docstring."""

    api = "sglang"

    @property
    def _config(self) -> Path:
        return self._work / "server.yaml"  # SGLang takes .yaml or .yml only

    def server_spec(self, model: str | None = None) -> SGLangServerSpec:
        """How the server starts, on the weights in ``model`` (default: the base model).
        Its key is in the config file :meth:`_popen` writes, not in the spec."""
        return SGLangServerSpec(
            model_path=model or str(self.model_dir),
            port=self.port,
            host=self.host,
            tp_size=self.tp_size,
            context_length=self.max_context,
            weight_version=str(self.version) if self.version >= 0 else None,
            enable_memory_saver=self.device != "cpu",
            extra_args=("--config", str(self._config)),  # written by write_key_config
            extra_env=self.gpu_env(),
        )

    def _popen(self, model: str, **popen_kwargs: Any) -> subprocess.Popen[bytes]:
        write_key_config(self._config, self.api_key)
        return launch_sglang(self.server_spec(model), **popen_kwargs)

    def _new_client(self) -> SGLangEngine:
        on_gpu = self.device.startswith("cuda")
        return SGLangEngine(
            self.url,
            self.name,
            capacity=1,
            api_key=self.api_key,
            policy_version=self.version,
            tensor_route=TensorRoute(self.device, self.tp_size) if on_gpu else None,
        )

    def _load(self, boards: BoardShards, version: int) -> None:
        client = self._engine()
        if client.tensor_route is not None:
            try:
                self._on_loop(client.update_weights(boards.by_name(version), version))
                return
            except TensorRouteUnavailable as exc:
                log.warning("%s: %s; loading weights from disk from now on", self.name, exc)
                client.tensor_route = None
        self._load_from_disk(boards, version)
