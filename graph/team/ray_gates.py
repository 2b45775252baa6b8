"""Gates as Ray tasks (`--ray auto|ADDRESS`): each asks the cluster for one device and runs the same
gate, in the same sandbox, on the host that holds it.

- The device a task asks for: `NPU` (Ray's resource for Ascend NPUs; Ray sets
  ASCEND_RT_VISIBLE_DEVICES for the task), a GPU (`num_gpus=1`, CUDA_VISIBLE_DEVICES), or on CPU
  hosts the custom resource `trainbridge_cpu_slot` that a host advertises once per slot of pinned
  cores (`ray start --resources '{"trainbridge_cpu_slot": 2}'`).
- What reaches the host: the job (JSON) and a git bundle of the candidate's branch (bytes). The host
  clones the bundle and checks out the two commits the job names by SHA, so the worktrees it judges
  are exactly those commits: no pickled object of the run, nothing the candidate could have altered.
- The verdict comes back as JSON and is validated as a Verdict. A worker (or host) that dies makes
  Ray run the task again elsewhere (`max_retries`); the graph records the one verdict it receives.

On the host, the task pins its gate process like a local slot (graph/team/gate_jobs.py): a CPU slot takes
the first free slot lock of that host (`<tmp>/trainbridge-slots/slot-N.lock`) and its share of cores;
a device slot takes the cores that go with its device index.
"""

from __future__ import annotations

import fcntl
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from trainbridge.graph.team.devices import Slot, host_slots
from trainbridge.graph.team.gate_jobs import GateJob, GateJobError, end_orphans, judge_on_slot, read_verdict

CPU_SLOT_RESOURCE = "trainbridge_cpu_slot"
DEVICE_RESOURCE = {"cpu": CPU_SLOT_RESOURCE, "npu": "NPU", "cuda": "GPU"}
MAX_RETRIES = 3  # a lost worker or host: the gate runs again on another one
INSTALL_HELP = "pip install 'trainbridge[team]' (Ray)"


class RayGateError(RuntimeError):
    """The Ray cluster cannot take the run's gates; the message says what to do."""


def _ray():
    try:
        import ray
    except ImportError:
        raise RayGateError(f"--ray needs Ray: {INSTALL_HELP}") from None
    return ray


def connect(address: str) -> Any:
    """This process as a driver of the cluster at `address` ("auto": the one `ray start` made here);
    reused when already connected (a test's local cluster, a second gate of the run)."""
    ray = _ray()
    if not ray.is_initialized():
        try:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RayGateError(f"cannot reach the Ray cluster at {address!r}: {exc} (start one with `ray start --head` "
                               f"and give its address, or --ray auto on a host of the cluster)") from None
    return ray


def cluster_width(config) -> int:
    """How many gates the cluster can run at once: its total of the run's device resource."""
    ray = connect(config.ray)
    name = DEVICE_RESOURCE[config.target]
    total = int(ray.cluster_resources().get(name, 0))
    if total < 1:
        raise RayGateError(f"the Ray cluster at {config.ray!r} offers no {name!r} resource for --target {config.target}"
                           + (f": start its hosts with `ray start --resources '{{\"{name}\": N}}'` (N slots of pinned cores)"
                              if config.target == "cpu" else ""))
    return total


def task_options(target: str) -> dict[str, Any]:
    """What one gate asks of the cluster: one device (and no CPU of Ray's own accounting, which the
    slot's pinned cores replace)."""
    options: dict[str, Any] = {"num_cpus": 0, "max_retries": MAX_RETRIES, "retry_exceptions": False}
    if target == "cuda":
        options["num_gpus"] = 1
    else:
        options["resources"] = {DEVICE_RESOURCE[target]: 1}
    return options


def judge_on_ray(ctx, job: GateJob) -> dict[str, Any]:
    """The gate of `job` as a Ray task; its validated verdict."""
    ray = connect(ctx.config.ray)
    bundle = candidate_bundle(ctx.user_repo.root, job)
    remote = ray.remote(ray_gate).options(**task_options(job.target), name=f"gate {job.candidate.get('name')}")
    try:
        return read_verdict(ray.get(remote.remote(job.model_dump_json(), bundle)))
    except ray.exceptions.RayError as exc:
        raise GateJobError(f"the Ray task of the gate for {job.candidate.get('name')} failed: {str(exc)[:2000]}") from None


def candidate_bundle(repo_root: Path, job: GateJob) -> bytes:
    """A git bundle of the candidate's branch: its commit and every ancestor, the baseline among them."""
    from trainbridge.tools.git.ops import run_git

    with tempfile.TemporaryDirectory(prefix="trainbridge-bundle-") as folder:
        path = Path(folder) / "candidate.bundle"
        run_git(repo_root, "bundle", "create", "-q", str(path), f"refs/heads/{job.candidate['branch']}")
        return path.read_bytes()


# --- on the worker host --------------------------------------------------------------------------


def ray_gate(job_json: str, bundle: bytes) -> str:
    """The Ray task: check out the job's two commits from the bundle, run the gate pinned to a slot of
    this host, return the verdict as JSON."""
    import json

    from trainbridge.sandbox.scratch import scratch_dir, sweep_stale

    job = GateJob.model_validate_json(job_json)
    end_orphans()  # a gate of this host whose worker was lost leaves its sandbox children on a slot's cores
    sweep_stale()  # and its folders
    with scratch_dir("trainbridge-gate-ray-") as folder:
        local = checkout_from_bundle(job, bundle, Path(folder))
        with held_slot(job.target) as slot:
            return json.dumps(judge_on_slot(local, slot))


def checkout_from_bundle(job: GateJob, bundle: bytes, root: Path) -> GateJob:
    """Worktrees of the job's baseline and candidate commits, from the bundle, under `root`; the job
    with its roots pointing at them. The commits are found by SHA, so they are the ones the run made."""
    from trainbridge.tools.git.ops import run_git

    (root / "candidate.bundle").write_bytes(bundle)
    run_git(root, "clone", "-q", "--no-checkout", str(root / "candidate.bundle"), str(root / "repo"))
    for name, sha in (("baseline", job.baseline_sha), ("candidate", job.candidate_sha)):
        run_git(root / "repo", "worktree", "add", "-q", "--detach", str(root / name), sha)
        if run_git(root / name, "rev-parse", "HEAD") != sha:
            raise GateJobError(f"the bundle's {name} is not {sha}")
    return job.model_copy(update={"baseline_root": str(root / "baseline"), "candidate_root": str(root / "candidate")})


@contextmanager
def held_slot(target: str) -> Iterator[Slot]:
    """This host's slot for the task: for a device, the one Ray gave it; for CPU, the first free slot
    lock of the host (Ray counts the slots, the lock says which cores)."""
    count = _host_resource(DEVICE_RESOURCE[target])
    if target != "cpu":
        ids = _assigned_devices(target)
        index = ids[0] if ids else 0
        slots = host_slots(f"{target}:0-{max(count, index + 1) - 1}", target=target)
        yield Slot(index=index, kind=target, device=None, cores=slots[index].cores)  # Ray already set the visibility
        return
    folder = Path(tempfile.gettempdir()) / "trainbridge-slots"
    folder.mkdir(exist_ok=True)
    slots = host_slots(f"cpu:{count}", target="cpu")
    for slot in slots:
        handle = open(folder / f"slot-{slot.index}.lock", "a+")  # noqa: SIM115 - held while the gate runs
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        try:
            yield slot
        finally:
            handle.close()
        return
    raise GateJobError(f"all {count} CPU slots of this host are held by other gates")


def _host_resource(name: str) -> int:
    import ray

    node = ray.get_runtime_context().get_node_id()
    for entry in ray.nodes():
        if entry.get("NodeID") == node:
            return max(1, int(entry.get("Resources", {}).get(name, 1)))
    return 1


def _assigned_devices(target: str) -> list[int]:
    import ray

    ids = ray.get_runtime_context().get_accelerator_ids().get(DEVICE_RESOURCE[target], [])
    return [int(i) for i in ids if str(i).isdigit()]
