"""A stand-in of the Hugging Face Hub's HTTP API, enough for huggingface_hub's
real `HfApi` (pointed at it with `endpoint=`) to check a token, create a
repository, commit files (regular and LFS) in one commit and read them back.
The endpoints are those the installed client calls (`hf_api.py`
`whoami`/`create_repo`/`model_info`/`list_repo_tree`/`_validate_yaml`,
`_commit_api.py` `_fetch_upload_modes`/`_send_commit`, `lfs.py`
`post_lfs_batch_info`/`lfs_upload`), with the checks the Hub makes:

- every API call needs `Authorization: Bearer <the token>`; another token is
  refused (401, `Invalid credentials in Authorization header`); a private
  repository is not found (401, `RepoNotFound`) without it;
- a repository is created under the token's user or one of its orgs (403
  otherwise), once (409 after);
- `preupload` answers `lfs` for binary or large files and weights, `regular`
  otherwise; the LFS batch gives a one-time upload URL per object (no token:
  it stands for S3's signed URLs), whose body must hash to the object's
  SHA-256 and have its size (400 otherwise), and a verify URL;
- a commit (NDJSON: a header, then `file` lines in base64 and `lfsFile`
  lines by SHA-256) is refused (422) when an LFS object was never uploaded or
  has another size, and is applied whole or not at all;
- a README's YAML front matter is checked by `validate-yaml`.

Committed files are kept per repository (`repos[...].files`, and each commit
in `repos[...].commits`) so tests read them back.

A repository may also stand for a model whose weights are not here: its
`safetensors` parameter counts by dtype are what `model_info` shows (the
Hub's `safetensors` field, asked with `expand=safetensors`, as the real Hub
answers an `expand`: only the fields asked, beside the id). No weight is
served: a download of one is not found.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote

import yaml

from tests.standins.server import Reply, Seen, StandIn, json_reply

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".onnx", ".model")
"""What the Hub's default `.gitattributes` sends to LFS."""
LFS_SIZE = 10 << 20  # bytes from which any file goes to LFS
LFS_JSON = {"Content-Type": "application/vnd.git-lfs+json"}
BAD_TOKEN = "Invalid credentials in Authorization header"


@dataclass
class StoredFile:
    """A file of a repository: its content, and its LFS SHA-256 when it went through LFS."""

    content: bytes
    lfs_sha256: str | None = None

    @property
    def git_oid(self) -> str:
        """The git blob id of the content (what `preupload` compares regular files by)."""
        return hashlib.sha1(b"blob %d\0" % len(self.content) + self.content).hexdigest()


@dataclass
class Commit:
    """A commit: its id, title and the paths it added."""

    oid: str
    summary: str
    added: list[str]


@dataclass
class Repo:
    """A model repository."""

    repo_id: str
    private: bool
    files: dict[str, StoredFile] = field(default_factory=dict)
    commits: list[Commit] = field(default_factory=list)
    safetensors: dict[str, int] | None = None
    """Parameters by dtype (`{"BF16": 8030261248}`) of weights the Hub has metadata of."""

    @property
    def head(self) -> str:
        """The latest commit's id."""
        return self.commits[-1].oid if self.commits else "0" * 40


class HubStandIn(StandIn):
    """The stand-in Hub: a user `user` with `orgs`, authenticated by `token`."""

    def __init__(self, token: str, user: str = "tester", orgs: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.token = token
        self.user = user
        self.orgs = orgs
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self._uploads: dict[str, tuple[str, int]] = {}

    def handle(self, request: Seen) -> Reply:
        path = unquote(request.path)
        if request.method == "PUT" and path.startswith("/lfs-upload/"):
            return self._lfs_put(path.removeprefix("/lfs-upload/"), request.body)
        auth = request.headers.get("authorization")
        authorized = auth == f"Bearer {self.token}"
        if auth is not None and not authorized:
            return json_reply(401, {"error": BAD_TOKEN}, **{"X-Error-Message": BAD_TOKEN})
        git = re.match(r"^/([^/]+/[^/]+)\.git/info/lfs/objects/(batch|verify)$", path)
        if git and request.method == "POST":
            if not authorized:
                return json_reply(401, {"message": "Unauthorized"})
            repo = self._repo(git.group(1))
            if repo is None:
                return json_reply(404, {"message": "Repository not found"})
            body = json.loads(request.body)
            if git.group(2) == "batch":
                return self._lfs_batch(body, repo.repo_id)
            return self._lfs_verify(body)
        if path == "/api/whoami-v2" and request.method == "GET":
            if not authorized:
                return json_reply(401, {"error": "Unauthorized"})
            return json_reply(200, self._whoami())
        if not authorized:
            if request.method == "GET" and path.startswith("/api/models/"):
                return self._read(path, request, authorized=False)
            return json_reply(401, {"error": "Unauthorized"})
        if path == "/api/repos/create" and request.method == "POST":
            return self._create(json.loads(request.body))
        if path == "/api/validate-yaml" and request.method == "POST":
            return self._validate_yaml(json.loads(request.body))
        if path.startswith("/api/models/"):
            if request.method == "GET":
                return self._read(path, request, authorized=True)
            return self._write(path, request)
        return json_reply(404, {"error": "Sorry, we can't find the page you are looking for."})

    # reading

    def _read(self, path: str, request: Seen, authorized: bool) -> Reply:
        match = re.match(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(/.*)?)?$", path)
        if match is None:
            return json_reply(404, {"error": "not found"})
        repo = self._repo(match.group(1))
        if repo is None or (repo.private and not authorized):
            return _repo_not_found(401 if repo is not None else 404)
        if match.group(2) is not None and match.group(3) != "main":
            return json_reply(
                404, {"error": "Revision not found"}, **{"X-Error-Code": "RevisionNotFound"}
            )
        if match.group(2) == "tree":
            return self._tree(repo, (match.group(4) or "").strip("/"), request.query)
        with self.lock:
            siblings = [{"rfilename": p} for p in sorted(repo.files)]
        expand = parse_qs(request.query).get("expand", [])
        if expand:  # the real Hub answers only the fields asked, beside the id
            known: dict[str, Any] = {}
            if "safetensors" in expand and repo.safetensors:
                counts = dict(repo.safetensors)
                known["safetensors"] = {"parameters": counts, "total": sum(counts.values())}
            if "sha" in expand:
                known["sha"] = repo.head
            return json_reply(200, {"_id": repo.repo_id, "id": repo.repo_id, **known})
        return json_reply(
            200,
            {
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "author": repo.repo_id.split("/")[0],
                "sha": repo.head,
                "private": repo.private,
                "disabled": False,
                "gated": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "siblings": siblings,
                "createdAt": "2026-01-01T00:00:00.000Z",
                "lastModified": "2026-01-01T00:00:00.000Z",
            },
        )

    def _tree(self, repo: Repo, under: str, query: str) -> Reply:
        recursive = parse_qs(query).get("recursive", ["False"])[0].lower() == "true"
        prefix = f"{under}/" if under else ""
        entries: list[dict[str, Any]] = []
        folders: set[str] = set()
        with self.lock:
            for path, stored in sorted(repo.files.items()):
                if not path.startswith(prefix):
                    continue
                rest = path[len(prefix) :]
                if "/" in rest and not recursive:
                    folders.add(prefix + rest.split("/", 1)[0])
                    continue
                entry: dict[str, Any] = {
                    "type": "file",
                    "oid": stored.git_oid,
                    "size": len(stored.content),
                    "path": path,
                }
                if stored.lfs_sha256 is not None:
                    entry["lfs"] = {
                        "oid": stored.lfs_sha256,
                        "size": len(stored.content),
                        "pointerSize": 134,
                    }
                entries.append(entry)
        entries += [
            {"type": "directory", "oid": "0" * 40, "size": 0, "path": f} for f in sorted(folders)
        ]
        return json_reply(200, entries)

    def _whoami(self) -> dict[str, Any]:
        return {
            "type": "user",
            "name": self.user,
            "fullname": self.user,
            "orgs": [{"type": "org", "name": org} for org in self.orgs],
            "auth": {
                "type": "access_token",
                "accessToken": {"displayName": "tests", "role": "write"},
            },
        }

    # writing

    def _create(self, body: dict[str, Any]) -> Reply:
        namespace = body.get("organization") or self.user
        name = body.get("name")
        repo_id = f"{namespace}/{name}"
        if body.get("type") not in (None, "model"):
            return json_reply(400, {"error": "the stand-in only holds model repositories"})
        if not isinstance(name, str) or not REPO_ID.match(repo_id):
            return json_reply(400, {"error": "Invalid repository name"})
        if namespace != self.user and namespace not in self.orgs:
            return json_reply(
                403, {"error": f'You don\'t have the rights to create a model under "{namespace}"'}
            )
        url = f"{self.url}/{repo_id}"
        with self.lock:
            if repo_id in self.repos:
                return json_reply(409, {"error": "You already created this model repo", "url": url})
            self.repos[repo_id] = Repo(repo_id, private=body.get("visibility") == "private")
        return json_reply(200, {"url": url, "name": repo_id})

    def _validate_yaml(self, body: dict[str, Any]) -> Reply:
        content = body.get("content", "")
        errors = []
        if content.startswith("---\n"):
            end = content.find("\n---", 4)
            if end < 0:
                errors.append("the metadata block is not closed")
            else:
                try:
                    meta = yaml.safe_load(content[4:end])
                except yaml.YAMLError:
                    meta = None
                    errors.append("the metadata is not valid YAML")
                if meta is not None and not isinstance(meta, dict):
                    errors.append("the metadata is not a mapping")
                elif isinstance(meta, dict):
                    base = meta.get("base_model")
                    if base is not None and not (isinstance(base, str) and REPO_ID.match(base)):
                        errors.append('"base_model" must be a Hub model id')
                    tags = meta.get("tags", [])
                    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
                        errors.append('"tags" must be a list of strings')
        if errors:
            return json_reply(400, {"errors": [{"message": e} for e in errors], "warnings": []})
        return json_reply(200, {"errors": [], "warnings": []})

    def _write(self, path: str, request: Seen) -> Reply:
        match = re.match(r"^/api/models/([^/]+/[^/]+)/(preupload|commit)/([^/]+)$", path)
        if match is None or request.method != "POST":
            return json_reply(404, {"error": "not found"})
        repo = self._repo(match.group(1))
        if repo is None:
            return _repo_not_found(404)
        namespace = repo.repo_id.split("/")[0]
        if namespace != self.user and namespace not in self.orgs:
            return json_reply(403, {"error": "You don't have write access to this repository"})
        if match.group(3) != "main":
            return json_reply(
                404, {"error": "Revision not found"}, **{"X-Error-Code": "RevisionNotFound"}
            )
        if match.group(2) == "preupload":
            return self._preupload(repo, json.loads(request.body))
        return self._commit(repo, request.body)

    def _preupload(self, repo: Repo, body: dict[str, Any]) -> Reply:
        answers = []
        for item in body.get("files", []):
            sample = base64.b64decode(item["sample"])
            lfs = item["path"].endswith(LFS_SUFFIXES) or item["size"] >= LFS_SIZE or b"\0" in sample
            with self.lock:
                stored = repo.files.get(item["path"])
            oid = None
            if stored is not None:
                oid = stored.lfs_sha256 if lfs else stored.git_oid
            answers.append(
                {
                    "path": item["path"],
                    "uploadMode": "lfs" if lfs else "regular",
                    "shouldIgnore": False,
                    "oid": oid,
                }
            )
        return json_reply(200, {"files": answers, "commitOid": repo.head})

    def _lfs_batch(self, body: dict[str, Any], repo_id: str) -> Reply:
        if body.get("operation") != "upload" or "basic" not in body.get("transfers", []):
            return json_reply(422, {"message": "only basic uploads are served"}, **LFS_JSON)
        objects = []
        for item in body.get("objects", []):
            oid, size = item.get("oid"), item.get("size")
            if not (
                isinstance(oid, str)
                and re.fullmatch(r"[0-9a-f]{64}", oid)
                and isinstance(size, int)
            ):
                objects.append(
                    {
                        "oid": str(oid),
                        "size": int(size or 0),
                        "error": {"code": 422, "message": "invalid object"},
                    }
                )
                continue
            with self.lock:
                stored = self.lfs.get(oid)
                if stored is not None and len(stored) == size:
                    objects.append({"oid": oid, "size": size})
                    continue
                nonce = secrets.token_hex(16)
                self._uploads[nonce] = (oid, size)
            objects.append(
                {
                    "oid": oid,
                    "size": size,
                    "authenticated": True,
                    "actions": {
                        "upload": {"href": f"{self.url}/lfs-upload/{nonce}"},
                        "verify": {"href": f"{self.url}/{repo_id}.git/info/lfs/objects/verify"},
                    },
                }
            )
        return json_reply(200, {"transfer": "basic", "objects": objects}, **LFS_JSON)

    def _lfs_put(self, nonce: str, content: bytes) -> Reply:
        with self.lock:
            expected = self._uploads.pop(nonce, None)
        if expected is None:
            return Reply(403, b"<Error><Code>AccessDenied</Code></Error>")
        oid, size = expected
        if len(content) != size or hashlib.sha256(content).hexdigest() != oid:
            return Reply(400, b"<Error><Code>BadDigest</Code></Error>")
        with self.lock:
            self.lfs[oid] = content
        return Reply(200, headers={"ETag": f'"{oid[:32]}"'})

    def _lfs_verify(self, body: dict[str, Any]) -> Reply:
        with self.lock:
            stored = self.lfs.get(str(body.get("oid")))
        if stored is None or len(stored) != body.get("size"):
            return json_reply(404, {"message": "object not found"}, **LFS_JSON)
        return json_reply(200, {"message": "ok"}, **LFS_JSON)

    def _commit(self, repo: Repo, payload: bytes) -> Reply:
        lines = [json.loads(line) for line in payload.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            return json_reply(400, {"error": "the commit does not start with its header"})
        header = lines[0]["value"]
        changes: dict[str, StoredFile] = {}
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value", {})
            if key == "file":
                if value.get("encoding") != "base64":
                    return json_reply(400, {"error": "file content must be base64"})
                changes[value["path"]] = StoredFile(base64.b64decode(value["content"]))
            elif key == "lfsFile":
                oid = value.get("oid")
                with self.lock:
                    content = self.lfs.get(str(oid))
                if content is None:
                    return json_reply(
                        422,
                        {"error": f"LFS object {oid} of {value.get('path')} was never uploaded"},
                    )
                if value.get("size") is not None and value["size"] != len(content):
                    return json_reply(422, {"error": f"LFS object {oid} has another size"})
                changes[value["path"]] = StoredFile(content, lfs_sha256=oid)
            else:
                return json_reply(400, {"error": f"the stand-in does not apply {key} lines"})
        oid = hashlib.sha1(payload + repo.head.encode()).hexdigest()
        with self.lock:
            repo.files.update(changes)
            repo.commits.append(Commit(oid, str(header.get("summary", "")), sorted(changes)))
        return json_reply(
            200,
            {
                "success": True,
                "commitOid": oid,
                "commitUrl": f"{self.url}/{repo.repo_id}/commit/{oid}",
                "hookOutput": "",
            },
        )

    def _repo(self, repo_id: str) -> Repo | None:
        with self.lock:
            return self.repos.get(repo_id)


def _repo_not_found(status: int) -> Reply:
    return json_reply(status, {"error": "Repository not found"}, **{"X-Error-Code": "RepoNotFound"})
