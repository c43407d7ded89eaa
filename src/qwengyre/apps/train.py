"""``qwengyre train``: build a run (model, proxy, cells, controller), run it, resume it.

Everything lives under the run directory::

    config.yaml        the resolved configuration (resume reads it back)
    warm_start/        the tiny model after its supervised warm start
    proxy.sqlite       every model call (TITO records) and execution
    proxy.json         the proxy's port and admin token (0600): a resumed run's proxy
                       comes back on the same address, so running harnesses reach it
    launches.jsonl     every execution launched, finished, every group dropped
    harnessd/          the harness daemon's socket, token, log and harness states
    ledger/            every group that finished its rollout (admitted trajectories),
                       one file each, written whole or not at all (qwengyre.runtime.ledger)
    assessments.jsonl  every assessment of every execution (final, intermediate, placeholder)
    metrics.jsonl      steps, roles, switches, load, groups (qwengyre.records.metrics)
    traces.jsonl       one line per execution, in the simulator's trace format
    checkpoints/       model + optimizer + what a resumed run needs (every step)
    workspaces/, logs/ per execution (with Ray harness hosts: under harness.dir, per node)
    report/            the HTML report, written at the end

Resume (``--resume RUN_DIR``): the newest checkpoint gives the weights, the optimizer,
the version and the groups it trained; the ledger's other groups are ready again (their
tokens are read from the ledger when each is taken for training). The
harnesses run under the run directory's harness daemon (:mod:`qwengyre.rollout.harnessd`),
which outlives a killed controller, and retry their model calls until the proxy is back
on the same address: the groups that were in rollout are taken over from the launch
journal (:mod:`qwengyre.runtime.journal`), their running executions re-adopted (each is
evaluated and counted once when its harness ends), those lost replaced, every other
harness the killed run left behind stopped. No finished group is lost, none is trained
twice, no execution is started twice. A run that loses its core (or a satellite during
the update's collectives) resumes itself so, up to ``run.restarts`` times, its harnesses
left running and re-adopted like a killed controller's; any other cell that dies is left
behind and the run goes on without it (:mod:`qwengyre.runtime.controller`).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aiohttp import web
from torch.distributed import TCPStore

from qwengyre.apps.preflight import preflight
from qwengyre.cluster.cell import CellSpec
from qwengyre.cluster.client import CellClient, EngineClient
from qwengyre.cluster.devices import rank_device
from qwengyre.cluster.local import ActorDied
from qwengyre.cluster.net import advertised, free_port
from qwengyre.cluster.placement import engine_name, start_cells, start_standalone, stop_cells
from qwengyre.cluster.standalone import StandaloneSpec
from qwengyre.config import Config, config_to_yaml, load_config
from qwengyre.proxy.build import build_proxy
from qwengyre.proxy.server import ProxyServer
from qwengyre.records.assessments import ASSESSMENTS_FILE, AssessmentLog
from qwengyre.records.metrics import RunRecord
from qwengyre.records.trace import TraceWriter
from qwengyre.report.sinks import open_metrics
from qwengyre.rollout.hosts import HostPool, LocalHarnessHost
from qwengyre.runtime.controller import Controller, RunOutputs
from qwengyre.runtime.display import show
from qwengyre.runtime.journal import JOURNAL_FILE, JournalState, LaunchJournal, adoption
from qwengyre.runtime.ledger import LEDGER_DIR, Ledger
from qwengyre.runtime.lock import lock_run_dir
from qwengyre.scheduler.core import ReadyGroup, Scheduler
from qwengyre.scheduler.events import STANDALONE, Start
from qwengyre.scheduler.staleness import predicted_staleness
from qwengyre.training.buffers import TrajectoryBuffer
from qwengyre.training.checkpoint import latest_checkpoint, read_checkpoint
from qwengyre.training.distributed import call_off, connect_store

__all__ = ["Resumed", "TrainOptions", "train"]

CONFIG_FILE = "config.yaml"
PROXY_FILE = "proxy.json"


@dataclass(kw_only=True, frozen=True)
class TrainOptions:
    run_dir: Path
    config: Config | None = None  # None with resume: the run's own config.yaml
    resume: bool = False
    log: Callable[[str], None] = print
    display: bool = True  # the live rich view (one line per step when not a terminal)


@dataclass(kw_only=True, frozen=True)
class Resumed:
    """What a resumed run starts from."""

    model_dir: Path
    checkpoint: Path | None
    version: int
    trained: list[int]
    trajectories: TrajectoryBuffer
    ready: list[ReadyGroup]  # the ready, untrained groups, in the order they became ready
    next_group: int
    next_execution: int
    journal: JournalState  # what the killed run launched (runtime.journal)


def run_config(options: TrainOptions) -> Config:
    """The run's config: the new run's, or the resumed run's config.yaml."""
    if options.resume:
        return load_config(options.run_dir / CONFIG_FILE)
    if options.config is None:
        raise ValueError("a new run needs a config")
    return options.config


def prepare_run_dir(options: TrainOptions) -> Config:
    """Write (or, resuming, read) the run's config.yaml; returns the run's config. The
    caller holds the run directory's lock (``train`` does), which checked that a new
    run's directory is empty."""
    config = run_config(options)
    if not options.resume:
        (options.run_dir / CONFIG_FILE).write_text(config_to_yaml(config))
    return config


def base_model(config: Config, run_dir: Path, log: Callable[[str], None]) -> Path:
    """The model the run starts from: the configured one, or the (warm-started) tiny one."""
    if config.model.path is not None:
        return config.model.path
    from qwengyre.models import cached_tiny_model

    tiny = cached_tiny_model(config.model.tiny_size)
    bounds, target = config.warm_start, config.warm_start.accuracy
    if target is None:
        return tiny
    out = run_dir / "warm_start"
    if (out / "config.json").exists():
        return out
    from qwengyre.apps.warm_start import cached_warm_start

    log(
        f"warm start: supervised, until accuracy >= {target:.2f} "
        f"(at most {bounds.max_steps} steps, {config.run.torch_threads} torch threads)"
    )
    result = cached_warm_start(  # raises WarmStartError (a ValueError) short of the target
        tiny,
        out,
        target_accuracy=target,
        max_steps=bounds.max_steps,
        seed=config.seed,
        log=log,
        threads=config.run.torch_threads,
        advice=f"raise warm_start.max_steps (now {bounds.max_steps}), lower "
        f"warm_start.accuracy (now {target:g}), or start from a trained "
        "model with model.path=DIR",
    )
    if result is not None:
        log(
            f"warm start: accuracy {result.accuracy:.2f} after {result.steps} steps, "
            f"{result.seconds:.0f} s (kept for later runs with the same settings)"
        )
    return out


def resume_state(run_dir: Path, model_dir: Path) -> Resumed:
    """The newest checkpoint, the ledger's untrained groups (each still on disk: a
    group's tokens are read when it is taken for training) and the launch journal (a
    fresh run: nothing)."""
    trajectories = TrajectoryBuffer()
    journal = LaunchJournal(run_dir / JOURNAL_FILE).read()
    ledger = Ledger(run_dir / LEDGER_DIR)
    ledger.discard_partial()  # the caller holds the run directory's lock
    stored = ledger.ready_groups()
    path = latest_checkpoint(run_dir / "checkpoints")
    state = read_checkpoint(path).state if path is not None else {}
    trained = [int(g) for g in state.get("trained_groups", [])]
    done = set(trained)
    ready = [group for group in stored if group.id not in done]
    for group in ready:
        trajectories.add(ledger.stored(group))
    known = [group.id for group in stored] + trained
    return Resumed(
        model_dir=model_dir,  # the architecture; the checkpoint's sharded weights go on top
        checkpoint=path,
        version=int(state.get("version", 0)),
        trained=trained,
        trajectories=trajectories,
        ready=ready,
        next_group=max(
            [int(state.get("next_group", 0)), journal.next_group, *(g + 1 for g in known)]
        ),
        next_execution=max(int(state.get("next_execution", 0)), journal.next_execution),
        journal=journal,
    )


async def _start_proxy(
    config: Config, model_dir: Path, run_dir: Path
) -> tuple[ProxyServer, web.AppRunner]:
    """The run's proxy; a resumed run's on the port and with the admin token of the run
    it resumes (:data:`PROXY_FILE`), so the harnesses that outlived it reach it again."""
    from transformers import AutoTokenizer

    saved = run_dir / PROXY_FILE
    address: dict[str, Any] = (
        json.loads(saved.read_text()) if saved.exists() else {"port": 0, "token": None}
    )
    server = build_proxy(
        config.proxy,
        model_dir,
        AutoTokenizer.from_pretrained(model_dir),
        run_dir,
        max_context=config.engine.max_context,
        temperature=config.trainer.temperature,
        admin_token=address["token"],
    )
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    # Harnesses on other nodes reach the proxy at proxy.host; local ones on loopback.
    host = config.proxy.host if config.harness.hosts == "ray" else "127.0.0.1"
    try:
        await web.TCPSite(runner, host, address["port"]).start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(
            f"the run's proxy port {address['port']} ({saved}) is taken: {exc}; the harnesses"
            " of the run resumed call it there; free the port and resume again"
        ) from exc
    port = runner.addresses[0][1]
    server.base_url = f"http://{advertised(host)}:{port}"
    if not saved.exists():
        fd = os.open(saved, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"port": port, "token": server.admin.token}, f)
    return server, runner


def _harness_hosts(config: Config, run_dir: Path, proxy: ProxyServer) -> HostPool:
    """The run's harness hosts (``harness.hosts``), ``harness.slots`` executions
    each; by default the rollout capacity over the hosts, so none waits for a host."""
    rollout = config.cells.count * config.cells.capacity + config.cells.standalone_capacity
    if config.harness.hosts == "local":
        slots = config.harness.slots or rollout
        return HostPool([LocalHarnessHost(run_dir, capacity=slots, hub=proxy, daemon=True)])
    from qwengyre.cluster.ray_harness import harness_nodes, start_ray_hosts

    nodes = harness_nodes()
    hosts = start_ray_hosts(
        nodes,
        capacity=config.harness.slots or math.ceil(rollout / len(nodes)),
        harness_dir=config.harness.dir or run_dir.resolve(),
        hub=proxy,
        proxy_url=proxy.base_url,
        admin_token=proxy.admin.token,
    )
    return HostPool(hosts)


@dataclass
class Engines:
    """The actors that serve rollout and train: the K cells, and the standalone pool
    when ``cells.standalone_capacity > 0``; how to start a cell again (``specs``, its
    ranks as first started) and the rendezvous store when this process serves it."""

    cells: list[CellClient]
    standalone: EngineClient | None = None
    specs: list[CellSpec] = field(default_factory=list)
    run_dir: Path = Path()
    store: TCPStore | None = None  # held here: no cell's death takes it with it
    _incarnations: Counter[int] = field(default_factory=Counter)

    async def replacement(self, cell: int) -> CellClient:
        """New processes for the ranks of ``cell`` (to connect): on the dead ones'
        devices, the core's with the newest checkpoint (its optimizer state)."""
        self._incarnations[cell] += 1
        latest = latest_checkpoint(self.run_dir / "checkpoints") if cell == 0 else None
        config = self.specs[0].config
        shards = config.cells.devices_per_cell
        again = [
            replace(
                spec,
                device=rank_device(spec.device, spec.rank * shards + spec.shard),
                checkpoint=str(latest) if latest is not None else None,
                incarnation=self._incarnations[cell],
            )
            for spec in self.specs
            if spec.rank == cell
        ]
        placement = config.run.placement
        (client,) = await asyncio.to_thread(start_cells, placement, again, run_dir=self.run_dir)
        return client

    def call_off(self, generation: int) -> None:
        """The cells forming ``generation``'s groups stop waiting (a member died); under
        Ray, where the core holds the store, they wait until the rendezvous times out."""
        if self.store is not None:
            call_off(self.store, generation)

    def stop(self) -> None:
        stop_cells([*self.cells, *([self.standalone] if self.standalone else [])])


async def _register(
    proxy: ProxyServer,
    engine: EngineClient,
    name: str,
    capacity: int,
    version: int,
    preference: int,
) -> None:
    endpoint = await engine.start_engine()
    proxy.router.register(endpoint.client(name, capacity, version), preference=preference)


async def _start_engines(
    config: Config, resumed: Resumed, run_dir: Path, proxy: ProxyServer
) -> Engines:
    """Start the cells (and the standalone pool) and register their engines with the
    proxy. Routing preference follows the paper: the standalone pool first, then the
    rollout cells in descending index."""
    board = f"qg-{uuid.uuid4().hex[:16]}"
    # Locally this process serves the rendezvous (on a port the kernel picks as it
    # binds: no other process can take it first): a cell's death, the core's included,
    # leaves it for the others to re-form their groups (Ray: the core, on its node).
    local = config.run.placement == "local"
    store = connect_store("tcp://127.0.0.1:0", master=True, timeout_s=600.0) if local else None
    init_method = f"tcp://127.0.0.1:{store.port if store is not None else free_port()}"
    specs = [
        CellSpec(
            rank=rank,
            shard=shard,
            init_method=init_method,
            store_on_core=not local,
            model_dir=str(resumed.model_dir),
            board=board,
            config=config,
            device=config.run.device,
            version=resumed.version,
            checkpoint=str(resumed.checkpoint) if resumed.checkpoint is not None else None,
        )
        for rank in range(config.cells.count)
        for shard in range(config.cells.devices_per_cell)
    ]
    cells = start_cells(config.run.placement, specs, run_dir=run_dir)
    engines = Engines(cells, specs=specs, run_dir=run_dir, store=store)
    try:
        await asyncio.gather(*(cell.connect() for cell in engines.cells))
        for rank, cell in enumerate(engines.cells):
            await _register(
                proxy, cell, engine_name(rank), config.cells.capacity, resumed.version, rank
            )
        if config.cells.standalone_capacity > 0:  # the core's board exists now
            spec = StandaloneSpec(str(resumed.model_dir), board, config)
            engines.standalone = start_standalone(config.run.placement, spec)
            await _register(
                proxy,
                engines.standalone,
                engine_name(STANDALONE),
                spec.capacity,
                resumed.version,
                preference=config.cells.count,
            )
    except BaseException:
        engines.stop()
        raise
    return engines


async def train(options: TrainOptions) -> Controller:
    """Run (or resume) a training run to ``run.steps`` updates; returns its controller.

    A cell that dies stops the run (``ActorDied``, naming it). With ``run.restarts``
    left, the run then resumes itself from its newest checkpoint, as ``--resume`` does:
    the groups that finished are kept, the executions that were running are re-adopted
    (their harnesses kept running through the restart, retrying their model calls
    until the proxy is back on its address).
    """
    run_dir = options.run_dir
    if options.resume and not (run_dir / CONFIG_FILE).exists():  # before any lock file
        raise ValueError(f"{run_dir} is not a training run (no {CONFIG_FILE}) to resume")
    # One hold for the whole run, restarts included: no other run gets in between. A
    # directory another run uses is refused with one line naming that run.
    with lock_run_dir(run_dir, new=not options.resume):
        restarts = 0
        while True:
            try:
                return await _train_once(options, restarts)
            except ActorDied as died:
                allowed = load_config(run_dir / CONFIG_FILE).run.restarts
                if restarts >= allowed:
                    raise
                restarts += 1
                options.log(f"{died}; restart {restarts} of {allowed}: resuming the run")
                options = replace(options, resume=True, config=None)


async def _train_once(options: TrainOptions, restarts: int) -> Controller:
    """One run of the loop in :func:`train`, the ``restarts``-th restart; a cell death it
    will resume from leaves the harnesses running, for the restart to re-adopt."""
    # In seconds, before the warm start; a new run's directory is left as it was found.
    checked = preflight(run_config(options), warn=options.log)
    config = prepare_run_dir(options)
    run_dir, log = options.run_dir, options.log
    # The warm start runs its own event loops (the toy harness in-process): a thread.
    model_dir = await asyncio.to_thread(base_model, config, run_dir, log)
    resumed = resume_state(run_dir, model_dir)
    if options.resume and resumed.version >= config.run.steps:
        raise ValueError(
            f"{run_dir} is complete: version {resumed.version} of run.steps="
            f"{config.run.steps}; to train on, raise run.steps in {run_dir / CONFIG_FILE}"
            " and resume again"
        )
    scheduler = Scheduler(config.scheduler_params())
    if options.resume:
        log(
            f"resume: version {resumed.version}, {len(resumed.trained)} groups trained, "
            f"{len(resumed.trajectories)} ready groups back"
        )
    proxy, site = await _start_proxy(config, resumed.model_dir, run_dir)
    metrics = open_metrics(run_dir, config, step=resumed.version)
    traces = TraceWriter(run_dir / "traces.jsonl", fsync=True)
    s = config.scheduler
    metrics.write(
        RunRecord(
            time_s=0.0,
            policy=s.policy,
            mu=s.mu,
            phi=s.phi,
            cells=config.cells.count,
            predicted_staleness=predicted_staleness(s.mu, s.phi),
            group_size=config.groups.size,
            batch=config.groups.batch,
            standalone_capacity=config.cells.standalone_capacity,
            dispatch=s.dispatch,
            streaming=s.streaming,
            engine_backend=config.engine.backend,
        )
    )
    engines = Engines([])
    hosts: HostPool | None = None
    keep_harnesses = False  # a death train() resumes from: the restart re-adopts them
    try:
        engines = await _start_engines(config, resumed, run_dir, proxy)
        hosts = _harness_hosts(config, run_dir, proxy)  # after the cells: Ray is up
        # on every node (a Ray node may lack bwrap)
        await hosts.check_sandbox(checked.harness.sandbox)
        taken_over = None
        if options.resume:
            settled = {g.id for g in resumed.ready} | set(resumed.trained)
            taken_over = adoption(resumed.journal, settled, await hosts.survivors())
            scheduler.resume(
                resumed.version,
                resumed.ready,
                next_group=resumed.next_group,
                next_execution=resumed.next_execution,
                in_flight=taken_over.groups,
            )
            stopped = ", ".join(
                f"{n} on {host}" for host, n in (await hosts.stop_orphans(taken_over.hosts)).items()
            )
            log(
                f"resume: {len(taken_over.groups)} groups in rollout taken over:"
                f" {len(taken_over.hosts)} running executions re-adopted,"
                f" {taken_over.lost} lost (replaced); stopped orphaned harnesses: {stopped}"
            )
        controller = Controller(
            config,
            scheduler,
            proxy,
            engines.cells,
            checked.tasks,
            checked.harness,
            RunOutputs(
                run_dir=run_dir,
                metrics=metrics,
                traces=traces,
                ledger=Ledger(run_dir / LEDGER_DIR),
                assessments=AssessmentLog(run_dir / ASSESSMENTS_FILE),
                journal=LaunchJournal(run_dir / JOURNAL_FILE),
            ),
            hosts=hosts,
            trajectories=resumed.trajectories,
            trained=resumed.trained,
            standalone=engines.standalone,
            adoption=taken_over,
            cluster=engines,
        )
        view = asyncio.create_task(show(controller)) if options.display else None
        try:
            await controller.run(Start(0.0))
        except ActorDied:
            keep_harnesses = restarts < config.run.restarts
            raise
        finally:
            if view is not None:
                view.cancel()
            await controller.shutdown(keep_harnesses=keep_harnesses)
        return controller
    finally:
        if hosts is not None:  # no harness outlives the run (a restart adopts them)
            await hosts.close(keep_harnesses=keep_harnesses)
        await site.cleanup()  # no new calls reach the cells while they stop
        engines.stop()
        proxy.store.close()
        metrics.close()
        traces.close()
