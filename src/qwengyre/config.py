"""The typed configuration tree: one place for every knob and its default.

A configuration is loaded from YAML (:func:`load_config`) and adjusted with
``dotted.key=value`` overrides; everything is validated by pydantic models that
refuse unknown keys, wrong types and out-of-range values. Every refusal is raised
as :class:`ConfigError` with one line naming the key, the value given and what is
allowed.

Defaults are the paper's where it states one (N=16, B=32, J_max=5, token weight
cap 5, execution clip [0.995, 1.005], Adam at a constant 1e-6, mu=1, phi=0, the
8-cell x 144-concurrency NL2RepoBench layout and its measured switch times).
The paper gives no values for rho_min and tau; ours are documented on
:class:`SchedulerConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from qwengyre.scheduler.core import SchedulerParams
from qwengyre.scheduler.staleness import burst_for_staleness
from qwengyre.types import TinySize

Policy = Literal["elastic", "async", "colocate"]
Supply = Literal["in_hand", "ready"]
Dispatch = Literal["boundary", "continuous"]
EngineBackend = Literal["embedded", "vllm", "sglang"]
TrainerBackendName = Literal["fsdp2"]  # qwengyre.training.backend.TRAINER_BACKENDS
# auto + qwengyre.proxy.parsers.TOOL_PARSERS; auto, none + REASONING_PARSERS
ToolParserName = Literal["auto", "hermes", "qwen3_coder"]
ReasoningParserName = Literal["auto", "none", "qwen3", "deepseek_r1"]
Variant = Literal["default", "token_sum", "per_trajectory_clip"]
"""The execution-level objective's variants (:mod:`qwengyre.training.objective`)."""
Placement = Literal["local", "ray"]
"""Where a run's processes live: local processes, or Ray actors (the 'ray' extra)."""
SandboxKind = Literal["auto", "none", "bwrap"]
"""What confines a harness (:mod:`qwengyre.rollout.sandbox`)."""


class ConfigError(ValueError):
    """A configuration value was refused; the message is one line meant for the user."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class GroupsConfig(_Section):
    """Rollout groups and batches."""

    size: int = Field(16, ge=1, description="N: valid executions per rollout group")
    oversample: int = Field(
        0, ge=0, description="extra executions dispatched per group; surplus is cancelled"
    )
    batch: int = Field(32, ge=1, description="B: rollout groups per training step")
    max_topups: int = Field(
        4,
        ge=0,
        description="executions launched beyond size+oversample to replace ones without a"
        " valid reward; a group that still falls short is dropped and replaced. Boundary"
        " dispatch: a short group's top-ups wait for the next weight publication (d(t) stays"
        " fixed within a burst, as the paper says) unless groups.reserve covers them; a"
        " dropped group's slot refills there too. Continuous dispatch: both at once",
    )
    min_valid: int | None = Field(
        None,
        ge=1,
        description="fewest valid rewards a group whose executions all ended may be trained"
        " with (advantages over the valid ones only); None = size, all N",
    )
    reserve: int = Field(
        0,
        ge=0,
        description="boundary dispatch only (an extension; 0 = the paper, d(t) fixed within a"
        " burst): executions of quota each burst holds back for top-ups, launched the moment"
        " a group falls short instead of at the next publication. The held reserve,"
        " min(reserve left, top-ups the groups in rollout may still get), counts in the"
        " waterlevel, so Eq 5/6 keep room"
        " for it and w(t) still never rises within a burst",
    )

    @model_validator(mode="after")
    def _min_valid_at_most_size(self) -> GroupsConfig:
        if self.min_valid is not None and self.min_valid > self.size:
            raise ValueError(
                f"groups.min_valid={self.min_valid} must be at most groups.size={self.size}"
            )
        return self


class SchedulerConfig(_Section):
    """Dispatch and role transitions (docs/design.md §2, Eqs 1-6).

    ``rho_min`` and ``tau_s`` (the supply check of Eq 5) are not given by the paper.
    ``rho_min = 0.25``: a cell moves only when a quarter of a batch is ready and
    unassigned, enough work to pay back an 8.5 s switch on any realistic model.
    ``tau_s = 30``: a few switch times, so a momentary spike of terminations does
    not move a cell, yet negligible against executions that last hours.
    ``supply``: what the supply check counts. ``in_hand`` (the default): the current
    batch's groups already in hand, assigned or ready (capped at B); ``ready``: the
    paper's ready-unassigned groups capped by what the batch still needs, which stops
    counting a group once a training cell takes it, so a batch being trained by the
    core alone never draws the satellites that would finish it sooner.
    """

    policy: Policy = "elastic"
    dispatch: Dispatch = "boundary"
    mu: int = Field(1, ge=1, description="training steps per burst")
    phi: float = Field(0.0, ge=0.0, description="extra dispatch, in units of B groups")
    target_staleness: float | None = Field(
        None,
        ge=0.0,
        description="if set, mu and phi are chosen per policy for this E[d] (Eq 2)",
    )
    rho_min: float = Field(0.25, gt=0.0, le=1.0, description="supply fraction of B (Eq 5)")
    tau_s: float = Field(30.0, ge=0.0, description="seconds the supply check must hold")
    supply: Supply = Field("in_hand", description="what the supply check counts (Eq 5)")
    streaming: bool = Field(True, description="train on ready groups before the batch is full")
    async_training_cells: int = Field(
        2, ge=1, description="async only: cells fixed in training (the rest roll out)"
    )

    @model_validator(mode="after")
    def _resolve_target_staleness(self) -> SchedulerConfig:
        """With a target E[d], mu and phi follow from the policy (given ones must agree)."""
        if self.target_staleness is None:
            return self
        shape = burst_for_staleness(self.policy, self.target_staleness)
        for key in ("mu", "phi"):
            given, picked = getattr(self, key), getattr(shape, key)
            if key in self.model_fields_set and not math.isclose(given, picked):
                raise ValueError(
                    f"scheduler.{key}={given} contradicts target_staleness="
                    f"{self.target_staleness}, which gives {key}={picked:g} for"
                    f" {self.policy}; set one or the other"
                )
            # Bypass validate_assignment: it would re-run this validator recursively.
            self.__dict__[key] = picked
        return self


class CellsConfig(_Section):
    """Elastic cells and the standalone pool (Eq 3)."""

    count: int = Field(8, ge=1, description="K: elastic cells; cell 0 is the core")
    capacity: int = Field(144, ge=1, description="C_e: concurrent executions per rollout cell")
    devices_per_cell: int = Field(
        1, ge=1, description="G: ranks (one device each) sharing a cell's model with FSDP2"
    )
    standalone_capacity: int = Field(0, ge=0, description="C_s: standalone rollout pool")
    standalone_device: str | None = Field(
        None, description="torch device of the standalone pool's engine; None = run.device"
    )
    rollout_to_training_s: float = Field(8.52, ge=0.0, description="switch cost (paper)")
    training_to_rollout_s: float = Field(3.46, ge=0.0, description="switch cost (paper)")


class TrainerConfig(_Section):
    """Trajectory selection and the execution-level objective (docs/design.md §2)."""

    backend: TrainerBackendName = Field(
        "fsdp2",
        description="what trains inside a cell (qwengyre.training.backend): fsdp2 shards the"
        " model over the cell's devices_per_cell ranks",
    )
    j_max: int = Field(5, ge=1, description="trajectories admitted per execution")
    token_weight_cap: float = Field(5.0, gt=0.0, description="cap on exp(l_t - b_t)")
    clip_low: float = Field(0.995, gt=0.0, le=1.0, description="execution ratio clip, low")
    clip_high: float = Field(1.005, ge=1.0, description="execution ratio clip, high")
    variant: Variant = Field(
        "default", description="objective variant (qwengyre.training.objective)"
    )
    optimizer: Literal["adam"] = "adam"
    lr: float = Field(1e-6, gt=0.0, description="learning rate")
    lr_warmup_steps: int = Field(
        0, ge=0, description="optimizer updates over which the learning rate rises linearly to lr"
    )
    grad_clip: float = Field(1.0, gt=0.0, description="global gradient-norm clip on the core")
    temperature: float = Field(
        1.0,
        gt=0.0,
        description="rollout sampling temperature: the proxy samples at it and the trainer's "
        "log-probs use it, so that l_t and b_t are under the same distribution",
    )
    micro_step_tokens: int = Field(
        8192,
        ge=16,
        description="token budget of one micro-step; a cell's G ranks share it (each trains "
        "~1/G of it, whole executions), so scale it with cells.devices_per_cell",
    )
    logprob_chunk_tokens: int = Field(
        1024, ge=1, description="rows of logits materialised at once for the log-probs"
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="compute precision of forward and backward (FSDP2 mixed precision); "
        "master weights, optimizer state and gradient reduction stay fp32",
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each decoder layer's activations in the backward"
    )
    cpu_offload: bool = Field(
        False,
        description="keep parameter shards, gradients and optimizer state in host memory "
        "(FSDP2 CPU offload; the optimizer steps on the CPU)",
    )
    routing_replay: bool = Field(
        True,
        description="an MoE policy's forward routes each recorded position to the experts "
        "the engine routed it to (rollout routing replay), its router weighting them; "
        "a dense policy ignores it",
    )

    def lr_at(self, update: int) -> float:
        """The learning rate of optimizer update ``update`` (0 for the first).

        ``lr * (update + 1) / (lr_warmup_steps + 1)`` during the warm-up, ``lr`` from
        update ``lr_warmup_steps`` on. A pure function of the update number, so a resumed
        run continues the schedule from its checkpointed version with no extra state.
        """
        if update < 0:
            raise ValueError(f"update={update}: must be >= 0")
        return self.lr * min(1.0, (update + 1) / (self.lr_warmup_steps + 1))


class ModelConfig(_Section):
    """The policy model: a HuggingFace directory, or the built-in tiny model."""

    path: Path | None = Field(None, description="HF model directory; None = the tiny model")
    tiny_size: TinySize = "demo"


class SimConfig(_Section):
    """The discrete-event simulator's workload and cost model."""

    workload: Literal["paper-122b", "paper-2p4t", "fixed", "trace"] = "paper-122b"
    trace: Path | None = Field(None, description="JSONL trace, for workload=trace")
    steps: int = Field(48, ge=1, description="training steps to simulate")
    publish_s: float = Field(30.0, ge=0.0, description="weight publication time")
    train_tokens_per_cell_s: float = Field(
        10_000.0, gt=0.0, description="training throughput of one cell, tokens/s"
    )
    train_step_overhead_s: float = Field(
        60.0, ge=0.0, description="per-step cost: pipeline fill/drain and optimizer update"
    )
    micro_step_tokens: int = Field(
        262_144, ge=1, description="tokens of one simulated micro-step (a cell takes one at a time)"
    )

    @model_validator(mode="after")
    def _trace_needs_path(self) -> SimConfig:
        if self.workload == "trace" and self.trace is None:
            raise ValueError("sim.workload=trace needs sim.trace=PATH")
        return self


class RunConfig(_Section):
    """The live training run (``qwengyre train``): how long, where its cells live, and
    how it recovers. ``device`` is also the device of ``rollout``'s and the servers'
    engines."""

    steps: int = Field(20, ge=1, description="RL training steps (optimizer updates) to run")
    placement: Placement = Field(
        "local", description="cells as local processes, or as Ray actors (the 'ray' extra)"
    )
    device: str = Field("cpu", description="torch device of the cells")
    torch_threads: int = Field(1, ge=1, description="torch threads per cell process")
    restarts: int = Field(
        0,
        ge=0,
        description="times a run whose core died (with no replacement left), or a cell during"
        " an update, resumes itself from its newest checkpoint (as --resume does) before it"
        " gives up",
    )
    replace_dead_cells: int = Field(
        0,
        ge=0,
        description="dead cells (the core included) the run replaces with a new process, with"
        " no restart: the live cells re-form their groups with it; the core's replacement"
        " takes over the newest published weights and the newest checkpoint's optimizer state"
        " (local placement only). Past that, a dead cell other than the core is left behind"
        " (the others re-form their groups without it) and the core's death stops the run",
    )

    @model_validator(mode="after")
    def _replacements_are_local(self) -> RunConfig:
        if self.replace_dead_cells and self.placement != "local":
            raise ValueError(
                "run.replace_dead_cells needs run.placement=local: a replacement under Ray"
                " placement is not built yet (use run.restarts)"
            )
        return self


class CheckpointConfig(_Section):
    """The checkpoints of a live run (``RUN_DIR/checkpoints``)."""

    every: int = Field(1, ge=1, description="steps between checkpoints")
    keep: int = Field(2, ge=1, description="newest checkpoints kept (older pruned)")


class WarmStartConfig(_Section):
    """The supervised warm start of the tiny model on the toy task, before RL."""

    accuracy: float | None = Field(
        0.25,
        gt=0.0,
        le=1.0,
        description="tiny model only: supervised warm start on the toy task until this "
        "measured episode reward (parity's chance level is 0.5; None: no warm start)",
    )
    max_steps: int = Field(
        250,
        ge=1,
        description="most warm-start updates; a warm start that has not measured "
        "warm_start.accuracy by then stops the run with an error (there is no time limit)",
    )


class HarnessLimitsConfig(_Section):
    """What one harness, with everything it starts, may use; enforced by the kernel
    (:mod:`qwengyre.rollout.limits`: a cgroup of its own where one can be made, else
    rlimits). ``null``: no limit."""

    max_processes: int | None = Field(
        1024,
        ge=1,
        description="processes and threads at once (cgroup pids.max, else RLIMIT_NPROC"
        " inside the sandbox's user namespace; unbound as root without a cgroup)",
    )
    max_memory_mb: int | None = Field(
        8192,
        ge=1,
        description="memory in MiB (cgroup memory limit, swap included; else RLIMIT_AS per"
        " process, which counts address space: raise it for Node-based harnesses)",
    )
    max_open_files: int | None = Field(
        4096, ge=1, description="open files per process (RLIMIT_NOFILE)"
    )


class HarnessConfig(_Section):
    """What runs each execution (``train`` and ``rollout``): the agent harness, the tasks
    it is given, its time budgets, where it runs and what confines it."""

    name: str = Field(
        "toy",
        description="toy, claude-code, claude-code-bare, mini-swe-agent, or a command template",
    )
    tasks: Path | None = Field(
        None,
        description="the tasks: a task JSONL, or FORMAT:PATH for a workload format -- swe:"
        " (SWE-bench / DeepSWE JSONL), terminal: (a directory of Terminal-Bench task"
        " directories), spec: (NL2RepoBench-style JSONL); None = the bundled toy tasks",
    )
    deadline_s: float = Field(120.0, gt=0.0, description="harness deadline per execution")
    budget_s: float = Field(
        300.0,
        gt=0.0,
        description="overall budget per execution: the harness, then evaluation retries",
    )
    hosts: Placement = Field(
        "local",
        description="where harnesses run and are evaluated: local = this process's machine;"
        " ray = one harness host per alive Ray node with CPUs, executions spread by free"
        " slots (needs run.placement=ray or Ray initialised; the proxy then binds"
        " proxy.host, which every node must reach)",
    )
    slots: int | None = Field(
        None,
        ge=1,
        description="executions one harness host runs at once (more wait for a slot); None ="
        " the rollout capacity (cells.count x cells.capacity + cells.standalone_capacity)"
        " divided over the hosts, so that no execution waits for a host",
    )
    dir: Path | None = Field(
        None,
        description="ray harness hosts: the directory on each node for workspaces and logs;"
        " None = the run directory's path (the same directory on a shared filesystem)",
    )
    sandbox: SandboxKind = Field(
        "auto",
        description="what confines each harness: bwrap (bubblewrap: no capabilities, the"
        " file system read-only but for its workspace and home, the run directories, the"
        " operator's home and the machine's sockets hidden, its own PID namespace and a"
        " network that reaches only its proxy; qwengyre.rollout.sandbox), none, or auto"
        " (bwrap where it can run, else none with a warning)",
    )
    sandbox_hide: list[Path] = Field(
        default_factory=list,
        description="more directories or files a sandboxed harness must not see, besides"
        " the run directory's parent, the operator's home, /root, /home, /run, /mnt,"
        " /media, /srv and the password and host-key files",
    )
    sandbox_expose: list[Path] = Field(
        default_factory=list,
        description="directories a sandboxed harness sees read-only even inside a hidden"
        " one (e.g. where the harness is installed), and inside every task's environment;"
        " the Python qwengyre runs on is",
    )
    environment_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="longest preparation of a task's environment before its launch (unpacking"
        " a root file system archive, pulling an image); a preparation that fails or runs"
        " over is the execution's complete failure (a zero-reward placeholder)",
    )
    environment_cache: Path | None = Field(
        None,
        description="where each node keeps prepared task environments (unpacked archives by"
        " digest, apptainer images); None = .qwengyre-environments beside the run directory",
    )
    limits: HarnessLimitsConfig = Field(default_factory=HarnessLimitsConfig)

    @model_validator(mode="after")
    def _budgets(self) -> HarnessConfig:
        if self.deadline_s > self.budget_s:
            raise ValueError(
                f"harness.deadline_s ({self.deadline_s}) must not exceed"
                f" harness.budget_s ({self.budget_s})"
            )
        return self


class MetricsConfig(_Section):
    """Where a live run's metrics go besides ``RUN_DIR/metrics.jsonl``
    (:mod:`qwengyre.report.sinks` lists the scalars)."""

    tensorboard: bool = Field(
        True, description="TensorBoard event files in RUN_DIR/tensorboard/ (tensorboard --logdir)"
    )
    wandb_project: str | None = Field(
        None,
        description="also log to this Weights & Biases project (pip install 'qwengyre[wandb]');"
        " None: no W&B",
    )
    wandb_entity: str | None = Field(None, description="W&B entity (team); None: your default")
    wandb_name: str | None = Field(None, description="W&B run name; None: the run directory's")
    wandb_mode: Literal["offline", "online", "disabled"] | None = Field(
        None,
        description="wandb.init mode; None: $WANDB_MODE if set, else offline (never needs the"
        " network; upload later with wandb sync RUN_DIR/wandb)",
    )


class ProxyConfig(_Section):
    """``qwengyre proxy serve``: the OpenAI/Anthropic-API proxy as a server of its own.

    It samples at ``trainer.temperature`` and caps each call at ``engine.max_context``, as
    the proxy inside ``train`` and ``rollout`` does (that one binds a free port on
    127.0.0.1, or on ``host`` when ``harness.hosts=ray`` puts harnesses on other
    nodes, and takes its other settings from here too where they apply). Its model
    engine runs on ``run.device`` with ``engine.dtype``, served by ``engine.backend``.
    The admin token itself is never
    a config key: ``--admin-token``, ``proxy.admin_token_file``, ``$QWENGYRE_ADMIN_TOKEN``,
    or generated and printed.
    """

    host: str = Field("127.0.0.1", description="address to bind; 127.0.0.1: this machine only")
    port: int = Field(8080, ge=1, le=65535, description="port to bind")
    engine: Literal["scripted", "embedded"] = Field(
        "scripted",
        description="scripted: replies from proxy.script; embedded: the model (engine.backend)",
    )
    script: Path | None = Field(None, description="JSON replies by request class (scripted)")
    store: Path | None = Field(
        None, description="directory of the durable store (proxy.sqlite); proxy serve needs it"
    )
    admin_token_file: Path | None = Field(
        None, description="file holding the admin API token (at least 16 characters)"
    )
    harness_sampling: bool = Field(
        False,
        description="honour the harness's temperature / top_p / top_k (default: every call "
        "samples at trainer.temperature without truncation, so the recorded log-probs are "
        "those the trainer computes)",
    )
    max_resident: int = Field(
        1024, ge=1, description="executions whose trees stay in memory (others: in the store)"
    )
    idle_s: float = Field(300.0, gt=0.0, description="an execution idle this long leaves memory")
    ping_s: float = Field(
        5.0, gt=0.0, description="a streamed answer pings after this long without output"
    )
    engine_wait_s: float = Field(
        120.0,
        ge=0.0,
        description="a call that finds no engine accepting waits this long for one (a cell"
        " on its way back to rollout, a crashed server starting again) before it is"
        " answered 529 overloaded; 0: at once",
    )
    classes: str | None = Field(
        None,
        description="the request-class rules of the harness behind the proxy: a built-in"
        " rule set (claude-code, codex, opencode, qwen-code) or a YAML file of one's own"
        " (docs/harnesses.md, Request classes); None: the one of harness.name when that"
        " preset has one (qwen-code, opencode, codex), else claude-code",
    )
    tool_parser: ToolParserName = Field(
        "auto",
        description="how the model writes tool calls, by vLLM's --tool-call-parser names:"
        " hermes (<tool_call>{json}</tool_call>), qwen3_coder (<function=...> XML); auto:"
        " found in the chat template (docs/harnesses.md, Model reply formats)",
    )
    reasoning_parser: ReasoningParserName = Field(
        "auto",
        description="how the model writes its reasoning, by vLLM's --reasoning-parser"
        " names: qwen3, deepseek_r1 (<think>...</think>); none: no reasoning; auto: qwen3"
        " when the chat template renders reasoning_content or <think>, else none",
    )
    max_reply_tokens: int | None = Field(
        None,
        ge=1,
        description="a run's reply-length limit: each call's reply at most this many tokens,"
        " whatever the harness asks (a client that sets none, as Codex, may otherwise take"
        " the rest of engine.max_context); None: the harness's own budget",
    )

    @field_validator("classes")
    @classmethod
    def _known_classes(cls, classes: str | None) -> str | None:
        builtin = rule_set_names()
        if classes is None:
            return None
        if classes not in builtin and not classes.endswith((".yaml", ".yml")):
            raise ValueError(f"neither a built-in rule set ({', '.join(builtin)}) nor a .yaml file")
        return classes


class EngineConfig(_Section):
    """The inference engine. ``backend`` serves rollout in ``train`` (one server per
    cell, and the standalone pool's), ``rollout`` and ``proxy serve``
    (``proxy.engine=embedded``): the embedded engine in-process, or a vLLM / SGLang
    server launched on the same devices (tensor parallel over a cell's devices), with a
    fresh API key, stopped with its owner. ``qwengyre engine serve`` serves the embedded
    engine alone (SGLang's HTTP API). ``train``'s engines bind ``host`` (on a free
    port): ``0.0.0.0`` lets a proxy on another node reach them, at this node's address.

    As in ``train``'s cells, it runs on ``run.device``, serves ``cells.capacity``
    concurrent requests and caps each at ``max_context`` tokens (the proxy too). The API key itself
    is never a config key: ``--api-key``, ``engine.api_key_file``, or generated and
    printed.
    """

    backend: EngineBackend = Field(
        "embedded",
        description="rollout servers: embedded (this package's engine), vllm (python from "
        "$QWENGYRE_VLLM_PYTHON) or sglang (python from $QWENGYRE_SGLANG_PYTHON)",
    )
    host: str = Field("127.0.0.1", description="address to bind; 127.0.0.1: this machine only")
    port: int = Field(30000, ge=1, le=65535, description="port to bind")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="weights and KV cache (train's cells: float32)"
    )
    api_key_file: Path | None = Field(None, description="file holding the bearer token")
    max_context: int = Field(
        4096, ge=64, description="tokens per model call, prompt + reply (engine and proxy)"
    )
    return_routed_experts: bool = Field(
        True,
        description="an MoE's engines report the experts of every position (what rollout"
        " routing replay replays; vLLM on a GPU only); a dense model ignores it",
    )


class EvaluationConfig(_Section):
    """How evaluation retries, and whether intermediate assessments are scheduled
    (:func:`qwengyre.rollout.evaluation.assess` takes this section as it is).

    The paper retries an invalid evaluation "within the execution's overall time
    budget" (``harness.budget_s``): ``max_attempts=None`` is that rule; a number also caps
    the attempts (frees the slot sooner when an evaluator fails deterministically).
    """

    retry_delay_s: float = Field(
        1.0, ge=0.0, allow_inf_nan=False, description="wait before the first retry"
    )
    retry_backoff: float = Field(
        2.0, ge=1.0, allow_inf_nan=False, description="each later wait is this times longer"
    )
    max_retry_delay_s: float = Field(
        30.0, ge=0.0, allow_inf_nan=False, description="longest wait between attempts"
    )
    max_attempts: int | None = Field(
        None, ge=1, description="cap on attempts; None = retry until the overall budget ends"
    )
    intermediate_every_s: float | None = Field(
        None,
        gt=0.0,
        allow_inf_nan=False,
        description="assess the workspace this often while the harness runs (intermediate"
        " assessments, kept per artifact version, never the reward); None = off",
    )

    def delay(self, retry: int) -> float:
        """The wait before retry number ``retry`` (1: the first retry)."""
        return min(self.max_retry_delay_s, self.retry_delay_s * self.retry_backoff ** (retry - 1))


class Config(_Section):
    """The root of the configuration tree."""

    seed: int = 0
    groups: GroupsConfig = Field(default_factory=GroupsConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    cells: CellsConfig = Field(default_factory=CellsConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    sim: SimConfig = Field(default_factory=SimConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    harness: HarnessConfig = Field(default_factory=HarnessConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        """Cross-section rules live with the scheduler's parameters (one place); an unset
        ``proxy.classes`` becomes the rule set ``harness.name`` brings
        (:func:`harness_rule_set`), so the resolved tree says which one classifies."""
        self.scheduler_params()
        if self.proxy.classes is None:
            self.proxy.classes = harness_rule_set(self.harness.name)
        return self

    def scheduler_params(self) -> SchedulerParams:
        """What the scheduler decides with, from the sections that hold it."""
        s, c, g = self.scheduler, self.cells, self.groups
        return SchedulerParams(
            policy=s.policy,
            dispatch=s.dispatch,
            group_size=g.size,
            oversample=g.oversample,
            max_topups=g.max_topups,
            min_valid=g.min_valid,
            batch=g.batch,
            mu=s.mu,
            phi=s.phi,
            cells=c.count,
            cell_capacity=c.capacity,
            standalone_capacity=c.standalone_capacity,
            rho_min=s.rho_min,
            tau_s=s.tau_s,
            supply=s.supply,
            streaming=s.streaming,
            async_training_cells=s.async_training_cells,
            reserve=g.reserve,
        )


def describe_error(err: ValidationError, model: type[BaseModel], what: str = "config") -> str:
    """One line for the first problem pydantic found validating ``model`` (a ``what``,
    e.g. ``config``): key, value given, what is allowed."""
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"])
    value = first.get("input")
    if first["type"] == "extra_forbidden":
        allowed = _allowed_keys(model, first["loc"])
        return f"unknown {what} key '{key}' (given {value!r}); {allowed}"
    message = first["msg"].removeprefix("Value error, ")
    if not key or isinstance(value, dict):
        return f"invalid {what}{' (' + key + ')' if key else ''}: {message}"
    return f"invalid {what} value {key}={value!r}: {message}"


def _allowed_keys(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    for part in loc[:-1]:
        if isinstance(part, int):  # an item of a list: the list's model stays
            continue
        nested = _model_of(model.model_fields[part].annotation)
        if nested is None:
            break
        model = nested
    where = ".".join(str(p) for p in loc[:-1]) or "the top level"
    return f"allowed keys at {where}: {', '.join(model.model_fields)}"


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds, also inside ``list[...]`` or ``... | None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_of, get_args(annotation)) if m is not None), None)


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ``["a.b=1", "c=x"]`` into a nested dict; values are parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override '{item}' must look like dotted.key=value")
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{item}' conflicts with an earlier override")
            node = child
        node[leaf] = yaml.safe_load(raw) if raw else ""
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        here = f"{prefix}{key}"
        if isinstance(value, dict):
            current = merged.get(key, {})
            if not isinstance(current, dict):
                raise ConfigError(f"'{here}' is a value, not a section (given {value!r})")
            merged[key] = _merge(current, value, f"{here}.")
        else:
            merged[key] = value
    return merged


BASE_KEY = "base"
"""A config file's top-level key naming what it extends (:func:`config_layers`)."""
DEFAULT_BASE = "embedded"
DEFAULTS = "defaults"
_PRESETS = Path(__file__).resolve().parent / "presets"
RULE_SETS = _PRESETS / "classes"
"""The built-in request-class rule sets, ``<name>.yaml`` (:mod:`qwengyre.proxy.classes`)."""


def rule_set_names() -> list[str]:
    """The names of the built-in request-class rule sets."""
    return sorted(p.stem for p in RULE_SETS.glob("*.yaml"))


DEFAULT_RULE_SET = "claude-code"
"""The rule set of a harness that brings none (``proxy.classes`` unset)."""


def harness_rule_set(harness: str) -> str:
    """The request-class rule set ``harness.name`` brings: the built-in one of its name
    (``qwen-code``, ``opencode``, ...), else :data:`DEFAULT_RULE_SET` (also
    ``claude-code-bare``'s, the toy's and a command template's)."""
    return harness if harness in rule_set_names() else DEFAULT_RULE_SET


@dataclass(frozen=True)
class ConfigLayer:
    """One file of a config's chain of bases: where it is and what it sets."""

    path: Path
    data: dict[str, Any]


def config_layers(path: str | Path) -> list[ConfigLayer]:
    """The files ``path`` resolves to, the deepest base first.

    A file's ``base:`` names what it extends: a bundled preset (``embedded``,
    ``paper-122b``, ...), another file (relative to this one), or ``defaults`` (the
    built-in defaults, the paper's scale). A file without one extends
    :data:`DEFAULT_BASE`, the ``embedded`` preset ``qwengyre train`` runs by default, so
    a small file of one's own changes only what it says."""
    layers: list[ConfigLayer] = []
    at: Path | None = Path(path)
    while at is not None:
        if any(layer.path == at.resolve() for layer in layers):
            chain = " -> ".join(str(layer.path) for layer in layers)
            raise ConfigError(f"config file {at}: its bases form a cycle ({chain} -> {at})")
        data = _read_yaml(at)
        base = data.pop(BASE_KEY, DEFAULT_BASE)
        layers.append(ConfigLayer(at.resolve(), data))
        at = None if base == DEFAULTS else _base_path(at, base)
    return layers[::-1]


def describe_bases(path: str | Path) -> str:
    """``path``'s chain of bases in words, e.g. ``my.yaml on preset embedded on the
    built-in defaults`` (what ``config show`` prints first)."""
    names = [
        f"preset {layer.path.stem}" if layer.path.parent == _PRESETS else str(layer.path)
        for layer in config_layers(path)[::-1]
    ]
    names[0] = str(path)
    return " on ".join([*names, "the built-in defaults"])


def _base_path(of: Path, base: Any) -> Path:
    if not isinstance(base, str) or not base:
        raise ConfigError(f"config file {of}: {BASE_KEY} must be a preset name, a file or defaults")
    preset = _PRESETS / f"{base}.yaml"
    if preset.is_file():
        return preset
    path = (of.parent / base).expanduser()
    if not path.is_file():
        presets = ", ".join(sorted(p.stem for p in _PRESETS.glob("*.yaml")))
        raise ConfigError(
            f"config file {of}: {BASE_KEY}: {base!r} is neither a preset ({presets}), a file,"
            f" nor {DEFAULTS}"
        )
    return path


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return loaded or {}


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    values: dict[str, Any] | None = None,
) -> Config:
    """Load YAML at ``path`` on its bases (:func:`config_layers`; no path: the
    built-in defaults), apply ``overrides``, validate.

    ``values``: typed values by dotted key (a command's shortcut flags), applied last,
    as overrides that are not parsed as YAML.
    Raises :class:`ConfigError` with a one-line message on any problem.
    """
    data: dict[str, Any] = {}
    if path is not None:
        for layer in config_layers(path):
            data = _merge(data, layer.data)
    data = _merge(data, parse_overrides(overrides or []))
    for key, value in (values or {}).items():
        *parents, leaf = key.split(".")
        nested: dict[str, Any] = {leaf: value}
        for part in reversed(parents):
            nested = {part: nested}
        data = _merge(data, nested)
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_error(exc, Config)) from None


def retarget(config: Config, target_staleness: float, policy: Policy | None = None) -> Config:
    """A copy of ``config`` aiming at E[d] = ``target_staleness`` (optionally for another
    policy): mu and phi are derived again by :func:`burst_for_staleness`."""
    data = config.model_dump()
    scheduler = data["scheduler"]
    del scheduler["mu"], scheduler["phi"]
    scheduler["target_staleness"] = target_staleness
    if policy is not None:
        scheduler["policy"] = policy
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_error(exc, Config)) from None


def config_to_yaml(config: Config) -> str:
    """The resolved configuration as YAML (paths as strings), loadable by :func:`load_config`
    as it is: every key set, on the built-in defaults."""
    data = {BASE_KEY: DEFAULTS, **config.model_dump(mode="json")}
    return yaml.safe_dump(data, sort_keys=False)
