"""Runpod: the API client, GPU choice and VRAM estimate, pod deletion that is
confirmed, and the target's settings. No Prefect here: the flows and blocks
build on it.

    from overbrainer_prefect.runpod import RunpodClient, plan_from_api, create_with_fallback
"""

from overbrainer_prefect.runpod.client import (
    DEFAULT_GRAPHQL_URL,
    DEFAULT_REST_URL,
    USER_AGENT,
    RetryPolicy,
    RunpodClient,
)
from overbrainer_prefect.runpod.deletion import (
    GONE_LOOKS,
    confirm_deleted,
    delete_and_confirm,
    delete_node_or_pod,
    look_up,
)
from overbrainer_prefect.runpod.errors import NoCapacity, PodNotGone, RunpodError
from overbrainer_prefect.runpod.gpus import (
    GpuChoice,
    GpuChoiceError,
    LaunchPlan,
    Placed,
    check_data_centers,
    choose_gpus,
    create_with_fallback,
    overpriced,
    plan_from_api,
    plan_launch,
)
from overbrainer_prefect.runpod.models import (
    Cloud,
    Cluster,
    ClusterRequest,
    DataCenter,
    GpuType,
    Pod,
    PodRequest,
    Secret,
    SshEndpoint,
    secret_ref,
)
from overbrainer_prefect.runpod.settings import (
    RunpodTargetSettings,
    SettingsError,
    settings_from,
)
from overbrainer_prefect.runpod.vram import (
    ModelShape,
    VramEstimate,
    VramEstimateError,
    estimate_vram,
    model_shape,
)

__all__ = [
    "DEFAULT_GRAPHQL_URL",
    "DEFAULT_REST_URL",
    "GONE_LOOKS",
    "USER_AGENT",
    "Cloud",
    "Cluster",
    "ClusterRequest",
    "DataCenter",
    "GpuChoice",
    "GpuChoiceError",
    "GpuType",
    "LaunchPlan",
    "ModelShape",
    "NoCapacity",
    "Placed",
    "Pod",
    "PodNotGone",
    "PodRequest",
    "RetryPolicy",
    "RunpodClient",
    "RunpodError",
    "RunpodTargetSettings",
    "Secret",
    "SettingsError",
    "SshEndpoint",
    "VramEstimate",
    "VramEstimateError",
    "check_data_centers",
    "choose_gpus",
    "confirm_deleted",
    "create_with_fallback",
    "delete_and_confirm",
    "delete_node_or_pod",
    "estimate_vram",
    "look_up",
    "model_shape",
    "overpriced",
    "plan_from_api",
    "plan_launch",
    "secret_ref",
    "settings_from",
]
