"""Sweeps over a Ray cluster: `flashkern tune OP... --ray ADDRESS|auto|local:N`.

The driver (this process) plans from the store as a sweep on one machine does (`Tuner.plan`: candidates already
stored are reused), for the device its workers measure on (asked of one of them), then runs the work as Ray tasks:
  builds   one task each, on any worker with a CPU (TileLang's C compile, or the sm_90a build whose resources
           prune spilling configs: on a CUDA sweep every node needs nvcc, as `flashkern compile-check` does);
  shapes   one task per shape once its builds are in, on a worker that owns the device (a GPU and one task at a
           time per GPU on a CUDA sweep, a CPU on a CPU sweep): the candidates checked against the reference,
           timed in interleaved rounds and the shape decided (`Measurer`), keyed by that worker's own device
           identity.
Results stream back as tasks finish, and only the driver writes the store (each build failure as it arrives, each
shape's results and decision as its task returns), so workers never open it. A worker that dies mid-task loses
nothing stored: Ray runs the task again on another worker (MAX_RETRIES), and rerunning a finished sweep measures
nothing. Ray is optional: `pip install -e ".[ray]"`.
"""

from __future__ import annotations

import dataclasses

from flashkern import registry
from flashkern.autotune import store as st
from flashkern.autotune.timing import default_threads
from flashkern.autotune.tuner import Measurer, ShapeWork, Summary, Tuner, build

MAX_RETRIES = 3  # runs of a task whose worker died, after the first
INSTALL = 'Ray is not installed: pip install -e ".[ray]" (or pip install "ray>=2.9")'


def connect(address: str):
    """ray, connected: "local:N" starts a cluster of N worker CPUs on this machine; "auto" joins the cluster this
    machine belongs to; anything else is a cluster address (host:port, or ray://host:port)."""
    try:
        import ray
    except ImportError:
        raise SystemExit(INSTALL) from None
    options = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if address.startswith("local:"):
        ray.init(num_cpus=int(address.split(":", 1)[1]), **options)
    else:
        ray.init(address=address, **options)
    return ray


def _device_of_workers(device: str):
    """A worker's own device identity and default timing threads (what the driver plans for)."""
    from flashkern import device as devices

    return devices.info(device), default_threads(device)


def _measure(work: ShapeWork, device: str, budget: float, threads: int, seed: int):
    return Measurer(device, budget, threads, seed).measure(work)


@dataclasses.dataclass
class _Shape:
    """A shape of the sweep, waiting for its builds."""

    tuner: Tuner
    work: ShapeWork
    builds_left: int


def tune(store: st.Store, sweep: dict[str, list], address: str, device: str | None = None, budget: float = 0.2,
         max_configs: int = 24, seed: int = 0, threads: int | None = None, progress=None) -> dict[str, Summary]:
    """Run `sweep` (operator name -> problems) on the Ray cluster at `address`; per operator, what it did."""
    ray = connect(address)
    try:
        if device is None:
            device = "cuda" if ray.cluster_resources().get("GPU", 0) else "cpu"
        on_device = dict(num_gpus=1, num_cpus=1) if device.startswith("cuda") else dict(num_cpus=1)
        info, worker_threads = ray.get(ray.remote(_device_of_workers).options(**on_device).remote(device))
        threads = threads or worker_threads
        build_task = ray.remote(build).options(num_cpus=1, max_retries=MAX_RETRIES)
        shape_task = ray.remote(_measure).options(**on_device, max_retries=MAX_RETRIES)
        summaries = {name: Summary() for name in sweep}
        pending = {}  # ObjectRef -> (operator, _Shape, the Build or None for the shape's own task)

        def measure(op, shape: _Shape) -> None:
            ref = shape_task.remote(shape.work, device, budget, threads, seed)
            pending[ref] = (op, shape, None)

        planned = []
        for name, problems in sweep.items():
            op = registry.get(name)
            tuner = Tuner(store, device, budget=budget, max_configs=max_configs, seed=seed, threads=threads,
                          info=info, progress=progress)
            works, builds = tuner.plan(op, problems, summaries[name])
            planned.append((op, {work.problem: _Shape(tuner, work, 0) for work, _ in works}, builds))
        if progress:
            progress(total=sum(len(builds) + sum(len(s.work.todo) + 1 for s in shapes.values())
                               for _, shapes, builds in planned), description=f"tuning {', '.join(sweep)} on Ray")
        for op, shapes, builds in planned:
            for b in builds:
                shapes[b.problem].builds_left += 1
                ref = build_task.remote(op.name, b.candidate.impl, b.problem, b.candidate.config, info)
                pending[ref] = (op, shapes[b.problem], b)
            for shape in shapes.values():
                if not shape.builds_left:
                    measure(op, shape)
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            op, shape, built = pending.pop(ref)
            summary = summaries[op.name]
            if built is None:
                outcome = ray.get(ref)
                shape.tuner.store_outcome(outcome, summary)
                if progress:
                    progress(advance=len(outcome.results) + 1)
                continue
            if not shape.tuner.store_build(op, built, *ray.get(ref), summary):
                shape.work.todo.remove(built.candidate)
                if progress:
                    progress(advance=1)  # the candidate is not measured
            shape.builds_left -= 1
            if not shape.builds_left:
                measure(op, shape)
        return summaries
    finally:
        ray.shutdown()
