"""The SSH keys of a run on a pod, made for that run alone.

- The client key: its private half is the only secret of a run kept, in
  `runs/<id>/.ssh/` (mode 0600, never uploaded to a target), and removed once
  no pod of the run is left; its public half goes into the pod's
  `authorized_keys`. When the runs are in an object store it is kept there
  too (the bucket is the runs directory, as private as a shared volume), so
  that another worker can reach the pod after this one is gone; each process
  reads it into its own staging directory when it needs it.
- The host key: generated here, its private half given to the pod through a
  Runpod account secret (never written on this machine), its public half
  pinned in `pod.json`, so that the pod's sshd is known before the first
  connection: never trust on first use.
"""

from __future__ import annotations

import base64
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr

from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store.records import RecordError

log = logging.getLogger(__name__)

SSH_DIR = ".ssh"
"""The run's SSH directory, in its local run directory (never uploaded)."""

CLIENT_KEY = "client_ed25519"
"""The run's private client key, in `SSH_DIR`."""

SSH_CONFIG = "config"
"""An OpenSSH client config reaching the run's pod, in `SSH_DIR`."""

KNOWN_HOSTS = "known_hosts"
"""The pod's pinned host key, for OpenSSH, in `SSH_DIR`."""

HOST_KEY_SECRET_PREFIX = "overbrainer-host-"
"""Runpod account secrets holding a run's host key: `overbrainer-host-<run id>`."""


@dataclass(frozen=True)
class PodKeys:
    """The keys of one run: where its client key is, the client's public key,
    the host's public key, and the host's private key (base64 of its OpenSSH
    text, for the Runpod secret only)."""

    client_key_path: Path
    client_public: str
    host_public: str
    host_private_b64: SecretStr


def alias(run_id: str) -> str:
    """The host alias of a run's pod in its ssh config: `overbrainer-<run id>`."""
    return f"overbrainer-{run_id}"


def host_key_secret(run_id: str) -> str:
    """The name of the Runpod secret holding the host key of the run's pod."""
    return f"{HOST_KEY_SECRET_PREFIX}{run_id}"


def generate(runs: Runs, run_id: str) -> PodKeys:
    """Generates the keys of the run `run_id`: writes the client key to
    `runs/<id>/.ssh/` (0600, with its `.pub`), and returns it with a host key
    kept in memory. Raises OSError when the key cannot be written."""
    ssh_dir = runs.run_dir(run_id) / SSH_DIR
    ssh_dir.mkdir(parents=True, exist_ok=True)
    ssh_dir.chmod(0o700)
    import asyncssh  # here, not at import: a flow run on a local target never needs it

    client = asyncssh.generate_private_key("ssh-ed25519", comment=alias(run_id))
    path = ssh_dir / CLIENT_KEY
    private = client.export_private_key("openssh")
    _write_private(path, private)
    if runs.store.direct:
        try:
            runs.write_bytes(run_id, f"{SSH_DIR}/{CLIENT_KEY}", private)
        except RecordError as error:
            raise OSError(f"cannot keep the client key in the store: {error}") from None
    public = client.export_public_key("openssh").decode().strip()
    (ssh_dir / f"{CLIENT_KEY}.pub").write_text(public + "\n")
    host = asyncssh.generate_private_key("ssh-ed25519", comment=f"{alias(run_id)}-host")
    host_public = " ".join(host.export_public_key("openssh").decode().split()[:2])
    host_private = base64.b64encode(host.export_private_key("openssh")).decode()
    return PodKeys(
        client_key_path=path,
        client_public=public,
        host_public=host_public,
        host_private_b64=SecretStr(host_private),
    )


def client_key_path(runs: Runs, run_id: str) -> Path:
    """Where the private client key of the run `run_id` is (or was) on this
    machine; from an object store, read into this process's staging directory
    when it is not there yet."""
    path = runs.run_dir(run_id) / SSH_DIR / CLIENT_KEY
    if runs.store.direct and not path.exists():
        try:
            private = runs.read_bytes(run_id, f"{SSH_DIR}/{CLIENT_KEY}")
        except (FileNotFoundError, RecordError):
            return path  # gone with its pods: the caller finds no key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.parent.chmod(0o700)
        _write_private(path, private)
    return path


def forget_client_key(runs: Runs, run_id: str) -> bool:
    """Removes the private client key of a run whose pods are all gone (here,
    and from an object store), best effort: True when it is gone from both,
    False when a removal failed (logged; the next collect tries again)."""
    removed = True
    try:
        (runs.run_dir(run_id) / SSH_DIR / CLIENT_KEY).unlink(missing_ok=True)
    except OSError as error:
        log.warning("cannot remove the client key of run %s: %s", run_id, error.strerror)
        removed = False
    if runs.store.direct:
        try:
            runs.remove(run_id, f"{SSH_DIR}/{CLIENT_KEY}")
        except RecordError as error:
            log.warning("cannot remove the client key of run %s from the store: %s", run_id, error)
            removed = False
    return removed


def write_ssh_config(
    runs: Runs, run_id: str, host: str, port: int, user: str, host_key: str
) -> Path:
    """Writes `runs/<id>/.ssh/config` and `known_hosts`, so that
    `ssh -F runs/<id>/.ssh/config overbrainer-<id>` reaches the pod with the
    run's key and checks its pinned host key. Returns the config's path.
    Raises OSError when they cannot be written."""
    ssh_dir = runs.run_dir(run_id) / SSH_DIR
    ssh_dir.mkdir(parents=True, exist_ok=True)
    name = alias(run_id)
    (ssh_dir / KNOWN_HOSTS).write_text(f"{name} {host_key}\n")
    config = ssh_dir / SSH_CONFIG
    config.write_text(
        "\n".join(
            [
                f"Host {name}",
                f"  HostName {host}",
                f"  Port {port}",
                f"  User {user}",
                f"  IdentityFile {ssh_dir / CLIENT_KEY}",
                "  IdentitiesOnly yes",
                f"  HostKeyAlias {name}",
                f"  UserKnownHostsFile {ssh_dir / KNOWN_HOSTS}",
                "  StrictHostKeyChecking yes",
                "",
            ]
        )
    )
    return config


def ssh_command(runs: Runs, run_id: str) -> str:
    """The command that reaches the run's pod:
    `ssh -F <runs>/<id>/.ssh/config overbrainer-<id>`."""
    return f"ssh -F {runs.run_dir(run_id) / SSH_DIR / SSH_CONFIG} {alias(run_id)}"


def _write_private(path: Path, content: bytes) -> None:
    """Writes a private key readable by its owner only, from its creation on."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, content)
    finally:
        os.close(fd)
