"""Which GPU types a run asks Runpod for, in which order, and what the pod
may cost: the launch plan, checked before anything is created.

`plan_launch` turns the target's settings and Runpod's catalog into a
`LaunchPlan`: the GPU types of an explicit list in its order, or with
`gpu_types = "auto"` every type with the VRAM (`min_vram_gb`, or the estimate
of the run's needs) at most `max_price_per_hour`, cheapest first. Each
problem (an unknown GPU type or data center, a price nothing meets, a VRAM
floor no type has) is one line, raised before any pod exists.
`create_with_fallback` then creates the pod on the first type with capacity.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from overbrainer_prefect.runpod.bootstrap import PodTiming, disk_per_hour
from overbrainer_prefect.runpod.client import RunpodClient
from overbrainer_prefect.runpod.errors import NoCapacity, RunpodError
from overbrainer_prefect.runpod.models import Cloud, DataCenter, GpuType, Pod, PodRequest
from overbrainer_prefect.runpod.settings import RunpodTargetSettings

log = logging.getLogger(__name__)

STOCK_ORDER = {"HIGH": 0, "MEDIUM": 1, "LOW": 2}
"""Among types of one price, the better stocked first; `NONE` goes last."""


class GpuChoiceError(ValueError):
    """The settings ask for GPU types or data centers Runpod cannot give; the
    message is one line saying what to change."""


@dataclass(frozen=True)
class GpuChoice:
    """One GPU type to try, with what the pod would cost on it per hour (its
    list price times the GPU count)."""

    gpu: GpuType
    gpu_count: int
    price_per_hour: float

    @property
    def id(self) -> str:
        """The GPU type id pods are created with."""
        return self.gpu.id

    def label(self) -> str:
        """`2 × NVIDIA A40 (48 GB)` or `NVIDIA A40 (48 GB)`."""
        count = f"{self.gpu_count} × " if self.gpu_count > 1 else ""
        return f"{count}{self.gpu.id} ({self.gpu.memory_gb:g} GB)"


@dataclass(frozen=True)
class LaunchPlan:
    """What a run will ask Runpod for and what ends its pod: logged (with
    `describe()`) before anything is spent."""

    choices: tuple[GpuChoice, ...]
    settings: RunpodTargetSettings
    """The target's settings the pod is made with and bounded by; their
    `max_cost_usd` is the cap the budget admitted (`money.pods.capped`)."""
    vram_floor_gb: float | None = None
    disk_per_hour: float = 0.0
    """What the container disk bills an hour, beside the GPUs."""
    checkpoint_hold_s: float = 0.0
    """How long past max_hours a job that saved the checkpoint asked for keeps its pod."""
    job_launch: str | None = None
    """How the job uses the pod's GPUs (`launch_summary`): processes and sharding."""
    pods: int = 1
    """The pods made at once for the job: an instant cluster's (a training
    across nodes). Each choice's price and `disk_per_hour` are theirs together
    (`for_pods`), so every bound on money counts them all."""

    @property
    def cloud(self) -> Cloud:
        """The cloud the pod is asked on."""
        return self.settings.api_cloud

    @property
    def max_hours(self) -> float:
        """Hours after which the pod's watchdog deletes it (without a renewed lease)."""
        return self.settings.max_hours

    @property
    def max_cost_usd(self) -> float | None:
        """Dollars at which the pod's watchdog deletes it, if any."""
        return self.settings.max_cost_usd

    @property
    def keep_pod(self) -> bool:
        """Whether nothing deletes the pod when its run ends."""
        return self.settings.keep_pod

    @property
    def first(self) -> GpuChoice:
        """The GPU type tried first."""
        return self.choices[0]

    @property
    def worst_case_usd(self) -> float | None:
        """The most the pod may cost on the first type without a renewed lease:
        `max_hours` and the checkpoint hold at its rate (its GPUs and its
        container disk), or `max_cost_usd` when lower; None for a kept pod
        (nothing bounds it)."""
        if self.keep_pod:
            return None
        hours = self.max_hours + self.checkpoint_hold_s / 3600
        bound = (self.first.price_per_hour + self.disk_per_hour) * hours
        return bound if self.max_cost_usd is None else min(bound, self.max_cost_usd)

    def describe(self) -> str:
        """The plan as one paragraph: the GPU type and its price, the types that
        follow when it has no capacity, and what ends the pod."""
        cloud = self.cloud.lower()
        first = self.first
        text = f"Runpod: {first.label()} on the {cloud} cloud at ${first.price_per_hour:.2f}/h"
        if self.pods > 1:
            each = first.price_per_hour / self.pods
            text = (
                f"Runpod: an instant cluster of {self.pods} pods of {first.label()} on the "
                f"{cloud} cloud at ${first.price_per_hour:.2f}/h in all ({self.pods} × "
                f"${each:.2f}/h)"
            )
        if self.settings.data_center_ids:
            text += f" in {', '.join(self.settings.data_center_ids)}"
        if self.vram_floor_gb is not None:
            text += f" (at least {self.vram_floor_gb:g} GB of VRAM per GPU)"
        if self.job_launch:
            text += f"; the job runs {self.job_launch}"
        rest = self.choices[1:]
        if rest:
            shown = ", ".join(f"{c.id} (${c.price_per_hour:.2f}/h)" for c in rest[:4])
            more = f" and {len(rest) - 4} more" if len(rest) > 4 else ""
            text += f"; without capacity, then {shown}{more}"
        if self.keep_pod:
            return (
                text + ". keep_pod is on: nothing deletes the pod when the run ends, not even "
                f"max_hours or max_cost_usd; it bills ${first.price_per_hour:.2f}/h until you "
                "remove it with the pods flow."
            )
        ends = [
            "once the run's files are retrieved and verified",
            f"by its watchdog at max_hours ({_hours(self.max_hours)}; later only while this "
            "flow follows a progressing job and renews its lease)",
        ]
        if self.max_cost_usd is not None:
            ends.append(f"at max_cost_usd (${self.max_cost_usd:.2f})")
        ends.append(f"{_minutes(self.settings.retrieve_grace_s)} after its job ends unretrieved")
        ends.append(f"{_minutes(self.settings.boot_grace_s)} after it starts if no job starts")
        deleted = "The pod is" if self.pods == 1 else "The cluster (every pod of it) is"
        text += f". {deleted} deleted " + ", ".join(ends[:-1]) + ", and " + ends[-1]
        if self.checkpoint_hold_s:
            text += (
                f" (a job that saved the checkpoint asked for at max_hours keeps it "
                f"{_minutes(self.checkpoint_hold_s)} more, for it to be retrieved)"
            )
        worst = self.worst_case_usd
        if worst is not None:
            text += f": at most ${worst:.2f} at this rate"
            top = max(c.price_per_hour for c in self.choices)
            if top > first.price_per_hour:
                text += f" (${top:.2f}/h at most on another type)"
            if self.disk_per_hour:
                text += f", its container disk included (${self.disk_per_hour:.4f}/h)"
        return text + "."


def for_pods(plan: LaunchPlan, pods: int) -> LaunchPlan:
    """`plan` for `pods` pods made at once (an instant cluster of them): each
    GPU type's price and the container disk's are the pods' together, so the
    budget, the ledger and the cost cap count every pod."""
    if pods <= 1:
        return plan
    choices = tuple(replace(c, price_per_hour=c.price_per_hour * pods) for c in plan.choices)
    return replace(plan, choices=choices, disk_per_hour=plan.disk_per_hour * pods, pods=pods)


@dataclass(frozen=True)
class Placed:
    """A pod created by `create_with_fallback`: the pod, the GPU type it got,
    and the types refused before it (no capacity or no access), in order."""

    pod: Pod
    choice: GpuChoice
    refused: tuple[str, ...] = ()


def choose_gpus(
    catalog: Sequence[GpuType],
    settings: RunpodTargetSettings,
    *,
    vram_floor_gb: float | None = None,
    floor_source: str = "min_vram_gb",
) -> list[GpuChoice]:
    """The GPU types to try, in order: the listed ones in their order, or for
    `auto` every type cheapest first; either way only those offered on the
    target's cloud with `gpu_count` GPUs, with at least `settings.min_vram_gb`
    (else `vram_floor_gb`, which `floor_source` names in messages) of VRAM,
    and costing at most `max_price_per_hour`.

    Raises GpuChoiceError with one line when a listed type is unknown (with
    near matches) or none is left (saying the largest VRAM or the cheapest
    price there is)."""
    cloud = settings.api_cloud
    count = settings.gpu_count
    floor = settings.min_vram_gb if settings.min_vram_gb is not None else vram_floor_gb
    source = "min_vram_gb" if settings.min_vram_gb is not None else floor_source
    if settings.is_auto:
        candidates = list(catalog)
        what = f"on the {cloud.lower()} cloud"
    else:
        by_id = {gpu.id: gpu for gpu in catalog}
        candidates = []
        for wanted in settings.gpu_types:
            gpu = by_id.get(wanted)
            if gpu is None:
                raise GpuChoiceError(_unknown_gpu(wanted, catalog))
            candidates.append(gpu)
        what = f"of gpu_types on the {cloud.lower()} cloud"

    offered = [gpu for gpu in candidates if gpu.price(cloud) is not None]
    if not offered:
        if not settings.is_auto and len(candidates) == 1:
            raise GpuChoiceError(
                f"GPU type {candidates[0].id} is not offered on the {cloud.lower()} cloud: "
                f"set cloud to {'community' if cloud == 'SECURE' else 'secure'}, or pick "
                "another type"
            )
        raise GpuChoiceError(f"no GPU type {what} is offered: change cloud or gpu_types")
    sized = [gpu for gpu in offered if (gpu.max_count(cloud) or count) >= count]
    if not sized:
        most = max((gpu.max_count(cloud) or 0) for gpu in offered)
        if len(offered) == 1:
            raise GpuChoiceError(
                f"GPU type {offered[0].id} has at most {most} GPUs in one pod on the "
                f"{cloud.lower()} cloud, not {count}: set gpu_count to {most} or less"
            )
        raise GpuChoiceError(
            f"no GPU type {what} offers {count} GPUs in one pod (at most {most}): lower gpu_count"
        )
    roomy = sized if floor is None else [gpu for gpu in sized if gpu.memory_gb >= floor]
    if not roomy:
        largest = max(sized, key=lambda gpu: gpu.memory_gb)
        raise GpuChoiceError(_too_small(floor or 0, source, what, largest, settings.is_auto))
    limit = settings.max_price_per_hour
    priced = [(gpu, _pod_price(gpu, cloud, count)) for gpu in roomy]
    affordable = [(gpu, price) for gpu, price in priced if limit is None or price <= limit + 1e-9]
    if not affordable:
        gpu, price = min(priced, key=lambda pair: pair[1])
        vram = f" with at least {floor:g} GB of VRAM" if floor is not None else ""
        raise GpuChoiceError(
            f"no GPU type {what}{vram} costs at most ${limit:.2f}/h: the cheapest is {gpu.id} at "
            f"${price:.2f}/h; raise max_price_per_hour"
        )
    if settings.is_auto:
        affordable.sort(
            key=lambda pair: (
                pair[0].availability == "NONE",
                pair[1],
                STOCK_ORDER.get(pair[0].availability or "", 3),
                -pair[0].memory_gb,
                pair[0].id,
            )
        )
    return [GpuChoice(gpu, count, price) for gpu, price in affordable]


def check_data_centers(wanted: Sequence[str], known: Sequence[DataCenter]) -> None:
    """Checks that every data center of `wanted` is one of `known`. Raises
    GpuChoiceError with one line naming the first unknown one and its near
    matches: Runpod refuses a whole create for one unknown id."""
    ids = [dc.id for dc in known]
    for dc in wanted:
        if dc in ids:
            continue
        near = difflib.get_close_matches(dc.upper(), ids, n=3, cutoff=0.6)
        hint = (
            f"did you mean {', '.join(near)}?"
            if near
            else f"known ids are like {', '.join(ids[:4])}"
        )
        raise GpuChoiceError(f"unknown data center {dc} in data_center_ids: {hint}")


def plan_launch(
    settings: RunpodTargetSettings,
    catalog: Sequence[GpuType],
    *,
    vram_floor_gb: float | None = None,
    floor_source: str = "the estimate of the run's needs",
    data_centers: Sequence[DataCenter] | None = None,
    job_launch: str | None = None,
) -> LaunchPlan:
    """The launch plan of a run on a target with `settings`, from Runpod's
    `catalog` (and its `data_centers`, to check `data_center_ids`).
    `vram_floor_gb` is the estimate of the run's needs per GPU, used when
    `min_vram_gb` is unset; `job_launch` says how the job uses the GPUs
    (`launch_summary(spec, settings.gpu_count)`). Raises GpuChoiceError with
    one line."""
    if settings.data_center_ids and data_centers is not None:
        check_data_centers(settings.data_center_ids, data_centers)
    choices = choose_gpus(catalog, settings, vram_floor_gb=vram_floor_gb, floor_source=floor_source)
    floor = settings.min_vram_gb if settings.min_vram_gb is not None else vram_floor_gb
    return LaunchPlan(
        choices=tuple(choices),
        settings=settings,
        vram_floor_gb=floor,
        disk_per_hour=disk_per_hour(settings.disk_gb),
        checkpoint_hold_s=PodTiming.from_env().checkpoint_hold_s,
        job_launch=job_launch,
    )


async def plan_from_api(
    client: RunpodClient,
    settings: RunpodTargetSettings,
    *,
    vram_floor_gb: float | None = None,
    floor_source: str = "the estimate of the run's needs",
    job_launch: str | None = None,
) -> LaunchPlan:
    """`plan_launch` with the catalog (and data centers, when any are set)
    read from Runpod. Raises GpuChoiceError with one line, or RunpodError
    (an invalid key: 401) when Runpod cannot be read."""
    catalog = await client.gpu_types(settings.api_cloud, settings.gpu_count)
    data_centers = await client.data_centers() if settings.data_center_ids else None
    return plan_launch(
        settings,
        catalog,
        vram_floor_gb=vram_floor_gb,
        floor_source=floor_source,
        data_centers=data_centers,
        job_launch=job_launch,
    )


async def create_with_fallback(
    client: RunpodClient,
    choices: Sequence[GpuChoice] | LaunchPlan,
    request_factory: Callable[[GpuChoice], PodRequest],
    *,
    before_attempt: Callable[[GpuChoice, PodRequest], None] | None = None,
) -> Placed:
    """Creates a pod on the first GPU type of `choices` that has capacity:
    each type's request comes from `request_factory` (give each a unique
    name), and `before_attempt` is called just before it is sent (to record
    the attempt: whatever dies then, the record names the pod to look for).
    A type without capacity (NoCapacity) or not open to the account (403)
    moves on to the next.

    Raises NoCapacity when no type had capacity, and RunpodError for any other
    refusal (a 402 stops at once: no type would do)."""
    plan = choices.choices if isinstance(choices, LaunchPlan) else tuple(choices)
    if not plan:
        raise GpuChoiceError("no GPU type to try")
    refused: list[str] = []
    for choice in plan:
        request = request_factory(choice)
        if before_attempt is not None:
            before_attempt(choice, request)
        try:
            pod = await client.create_pod(request)
        except NoCapacity:
            log.info("no capacity for %s; trying the next GPU type", choice.id)
            refused.append(f"{choice.id} (no capacity)")
            continue
        except RunpodError as error:
            if error.status != 403:
                raise
            log.warning("%s for %s; trying the next GPU type", error.run_message, choice.id)
            refused.append(f"{choice.id} (no access)")
            continue
        return Placed(pod, choice, tuple(refused))
    tried = ", ".join(choice.id for choice in plan)
    raise NoCapacity(
        tried,
        hint=f"none of the GPU types tried has capacity right now ({tried}): try again later, "
        "or add GPU types, another cloud or other data centers",
    )


def overpriced(pod: Pod, settings: RunpodTargetSettings, expected: float) -> str | None:
    """One line when the created `pod` bills more than `max_price_per_hour`
    (Runpod can place a pricier machine than listed), or more than a tenth
    above the `expected` list price with no limit set; None when its rate is
    fine. The caller deletes an overpriced pod."""
    rate = pod.cost_per_hr
    if rate is None:
        return None
    limit = settings.max_price_per_hour
    if limit is not None and rate > limit + 1e-9:
        return (
            f"pod {pod.id} bills ${rate:.2f}/h, above max_price_per_hour (${limit:.2f}/h): it "
            "is deleted"
        )
    if limit is None and rate > expected * 1.1 + 1e-9:
        log.warning("pod %s bills $%.2f/h, the list price was $%.2f/h", pod.id, rate, expected)
    return None


def _pod_price(gpu: GpuType, cloud: Cloud, count: int) -> float:
    return (gpu.price(cloud) or 0.0) * count


def _unknown_gpu(wanted: str, catalog: Sequence[GpuType]) -> str:
    """The line for a GPU type id the catalog lacks, with its near matches
    (by id and by display name, which is not an id)."""
    names: dict[str, str] = {}
    for gpu in catalog:
        names[gpu.id.lower()] = gpu.id
        names.setdefault(gpu.display_name.lower(), gpu.id)
    key = wanted.lower()
    near: list[str] = []
    if key in names:
        near.append(names[key])
    for match in difflib.get_close_matches(key, list(names), n=5, cutoff=0.5):
        if names[match] not in near:
            near.append(names[match])
    for name, gpu_id in names.items():
        if len(key) >= 3 and key in name and gpu_id not in near:
            near.append(gpu_id)
    if near:
        shown = ", ".join(f'"{gpu_id}"' for gpu_id in near[:3])
        return f'unknown GPU type "{wanted}" in gpu_types: did you mean {shown}?'
    return f'unknown GPU type "{wanted}" in gpu_types: use the ids of the Runpod GPU catalog'


def _too_small(floor: float, source: str, what: str, largest: GpuType, auto: bool) -> str:
    fix = (
        "lower min_vram_gb"
        if source == "min_vram_gb"
        else "use adapter qlora or lora, a shorter sequence_len or a smaller micro_batch_size, "
        "or set min_vram_gb to override the estimate"
    )
    if not auto:
        fix += ", or list larger GPU types"
    return (
        f"no GPU type {what} has {floor:g} GB of VRAM ({source}): the largest is "
        f"{largest.id} with {largest.memory_gb:g} GB; {fix}"
    )


def _hours(hours: float) -> str:
    return f"{hours:g} h"


def _minutes(seconds: float) -> str:
    if seconds >= 60:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"
