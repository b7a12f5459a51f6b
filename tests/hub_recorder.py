"""A stand-in for ``huggingface_hub.HfApi`` that records uploads, for the offline Hub tests (spec §6)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from huggingface_hub.errors import EntryNotFoundError


class RecordingHubApi:
    """Stands in for ``huggingface_hub.HfApi``: records repositories and commits and keeps every uploaded file."""

    instances: list["RecordingHubApi"] = []

    #: The namespace the Hub puts a repository id without one in (the user's).
    user = "someone"

    def __init__(self, token=None, **kwargs):
        self.token, self.repos, self.commits, self.branches = token, [], [], []
        RecordingHubApi.instances.append(self)

    def create_repo(self, repo_id, private=None, exist_ok=False, **kwargs):
        self.repos.append({"repo_id": repo_id, "private": private, "exist_ok": exist_ok})
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"{self.user}/{repo_id}")

    def create_branch(self, repo_id, branch, exist_ok=False, **kwargs):
        self.branches.append({"repo_id": repo_id, "branch": branch, "exist_ok": exist_ok})

    def hf_hub_download(self, repo_id, filename, revision=None, local_dir=None, **kwargs):
        """A file of an earlier commit to ``repo_id`` (on any revision); the Hub's error when there is none."""
        for api in reversed(RecordingHubApi.instances):
            for commit in reversed(api.commits):
                if commit["repo_id"] == repo_id and filename in commit["files"]:
                    path = Path(local_dir) / filename
                    path.write_bytes(commit["files"][filename])
                    return str(path)
        raise EntryNotFoundError(f"{repo_id} has no {filename}")

    def create_commit(self, repo_id, operations, commit_message=None, **kwargs):
        files = {}
        for operation in operations:
            source = operation.path_or_fileobj
            files[operation.path_in_repo] = source if isinstance(source, bytes) else Path(source).read_bytes()
        self.commits.append({"repo_id": repo_id, "files": files, "message": commit_message, **kwargs})
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0", oid="0")


def single_commit(recorder: type[RecordingHubApi]) -> dict:
    """The one commit recorded since the recorder was installed."""
    commits = [commit for api in recorder.instances for commit in api.commits]
    assert len(commits) == 1, commits
    return commits[0]
