"""Models by Hugging Face Hub id, through huggingface_hub and its cache.

    org/repo                 a model folder: the files tandem loads (config, tokenizer,
                             generation config, chat template, safetensors), nothing else
    org/repo:Q4_K_M          a GGUF repository's file of that quantization
    org/repo/file.gguf       one GGUF file by name

The files land in the hub's cache (HF_HOME, HF_HUB_CACHE), shared with transformers and
vLLM; a download that stops resumes; HF_TOKEN authenticates; HF_ENDPOINT names another
hub; HF_HUB_OFFLINE=1 loads what the cache holds and refuses, by name, what it does
not. A GGUF repository without a tag takes Q4_K_M when it has one (as llama-server and
Ollama do), else its only GGUF file. A path that exists locally is always a path.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import ModelLoadError
from tandem.models.gguf_split import PART, split_parts

logger = logging.getLogger("tandem.hub")

# org/repo, org/repo:TAG or org/repo/file.gguf (the Hub's own name rules: letters,
# digits, "-", "_", "." in each part).
_PART = r"[A-Za-z0-9][\w.-]*"
_HUB_ID = re.compile(
    rf"^(?P<repo>{_PART}/{_PART})(?::(?P<tag>[\w.-]+)|/(?P<file>[\w./-]+\.gguf))?$"
)
# The files a model folder needs (weights.py and loader.py read no others).
FOLDER_FILES = [
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
    "*.safetensors", "model.safetensors.index.json",
]  # fmt: skip
DEFAULT_TAG = "Q4_K_M"


@dataclass(frozen=True)
class HubId:
    repo_id: str
    tag: str | None = None  # a GGUF quantization, as in the file names (Q4_K_M)
    filename: str | None = None  # a GGUF file in the repository

    def __str__(self) -> str:
        suffix = f":{self.tag}" if self.tag else f"/{self.filename}" if self.filename else ""
        return self.repo_id + suffix


def parse_hub_id(name: str | Path) -> HubId | None:
    """The Hub id ``name`` spells, or None (a local path, a catalog name, anything else).
    A path that exists is never an id."""
    text = str(name)
    if Path(text).exists() or text.startswith((".", "/", "~")):
        return None
    match = _HUB_ID.match(text)
    if match is None:
        return None
    return HubId(match["repo"], match["tag"], match["file"])


def gguf_tag(filename: str) -> str | None:
    """The quantization a GGUF file's name states (``...-Q4_K_M.gguf`` -> Q4_K_M)."""
    part = PART.match(Path(filename).name)
    stem = part["stem"] if part else filename.removesuffix(".gguf")
    match = re.search(r"[-_.]((?:I?Q\d[\w]*)|F16|BF16|F32|MXFP4\w*|TQ\d_\d)$", stem, re.I)
    return match[1].upper() if match else None


def _is_mmproj(filename: str) -> bool:
    return "mmproj" in Path(filename).name.lower()


def choose_gguf(hub_id: HubId, files: list[str]) -> list[str]:
    """The GGUF file(s) the id names among the repository's ``files`` (every part of a
    split file); raises ModelLoadError naming what the repository offers."""
    ggufs = [f for f in files if f.endswith(".gguf") and not _is_mmproj(f)]
    if hub_id.filename is not None:
        if hub_id.filename not in files:
            raise ModelLoadError(f"{hub_id.repo_id} has no file {hub_id.filename!r}")
        chosen = [hub_id.filename]
    else:
        tags: dict[str, list[str]] = {}
        for name in ggufs:
            tags.setdefault(gguf_tag(name) or Path(name).name, []).append(name)
        tag = (hub_id.tag or "").upper()
        if not tag:
            if DEFAULT_TAG in tags:
                tag = DEFAULT_TAG
            elif len(tags) == 1:
                tag = next(iter(tags))
        if tag not in tags:
            offered = ", ".join(sorted(tags)) or "no GGUF files"
            what = f"no {hub_id.tag} file" if hub_id.tag else "several GGUF files; pick one"
            raise ModelLoadError(f"{hub_id.repo_id} has {what} (it offers: {offered})")
        chosen = sorted(tags[tag])
    parts = split_parts(chosen[0])
    if parts is None:
        if len(chosen) > 1:
            raise ModelLoadError(f"{hub_id}: several files match ({', '.join(chosen)}); name one")
        return chosen
    wanted = [str(p) for p in parts]  # every part of the split model (gguf_split.py)
    missing = sorted(set(wanted) - set(files))
    if missing:
        raise ModelLoadError(f"{hub_id}: parts of {chosen[0]} are missing: {', '.join(missing)}")
    return wanted


def _offline_error(hub_id: HubId, revision: str | None) -> ModelLoadError:
    from huggingface_hub import constants

    at = f" at revision {revision}" if revision else ""
    return ModelLoadError(
        f"{hub_id}{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
        f"the hub cannot be reached (HF_HUB_OFFLINE, or no network): download it where "
        f"the hub is reachable (`tandem pull {hub_id}`), or pass a local path"
    )


def resolve(name: str | Path, revision: str | None = None) -> Path:
    """The local folder or GGUF file for Hub id ``name``, downloaded into the cache
    unless it is there already (then no network is needed)."""
    hub_id = parse_hub_id(name)
    if hub_id is None:
        raise ModelLoadError(f"{name!r} is not a Hugging Face model id (org/repo[:TAG])")
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:  # the cache alone, before the client's heavy imports
        return _cached(hub_id, revision)
    import huggingface_hub
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        files = _repo_files(hub_id, revision)
        if files is None:  # offline: the cached snapshot decides
            return _cached(hub_id, revision)
        if hub_id.tag is None and hub_id.filename is None and "config.json" in files:
            folder = huggingface_hub.snapshot_download(
                hub_id.repo_id, revision=revision, allow_patterns=FOLDER_FILES
            )
            return Path(folder)
        chosen = choose_gguf(hub_id, files)
        projectors = [f for f in files if f.endswith(".gguf") and _is_mmproj(f)]
        if projectors:  # (for the vision models: not read yet)
            logger.warning(
                "%s also has an image projector (%s): not downloaded; tandem reads no "
                "images yet", hub_id.repo_id, ", ".join(projectors),
            )  # fmt: skip
        paths = [huggingface_hub.hf_hub_download(hub_id.repo_id, name, revision=revision)
                 for name in chosen]  # fmt: skip
        return Path(paths[0])  # (a split model: its first part; the others beside it)
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise ModelLoadError(
            f"{hub_id.repo_id}: the hub refused it ({type(exc).__name__}): check the id, "
            "and HF_TOKEN for a private or gated repository"
        ) from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"{hub_id.repo_id} has no revision {revision!r}") from None
    except EntryNotFoundError as exc:
        raise ModelLoadError(f"{hub_id}: a file is missing on the hub ({exc})") from None
    except LocalEntryNotFoundError:
        raise _offline_error(hub_id, revision) from None
    except HfHubHTTPError as exc:
        raise ModelLoadError(f"{hub_id}: the hub answered {exc}") from None


def _repo_files(hub_id: HubId, revision: str | None) -> list[str] | None:
    """The repository's files, or None when the hub cannot be reached (offline, no
    network, the hub down): then the cache decides."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if constants.HF_HUB_OFFLINE:
        return None
    if not _answers(constants.ENDPOINT):
        logger.warning("nothing answers at %s: looking in the cache", constants.ENDPOINT)
        return None
    try:
        return HfApi().list_repo_files(hub_id.repo_id, revision=revision)
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError):
        raise
    except Exception as exc:  # the client's connection and server errors alike
        logger.warning("the hub cannot be reached (%s): looking in the cache", exc)
        return None


def _answers(endpoint: str) -> bool:
    """Whether a connection to the hub can be made at all, asked once through the
    client's own session (its proxies and certificates): the listing retries a refused
    connection or an unknown name five times with backoff, about 25 s before the cache
    is looked in, which every offline start would wait. Anything else that goes wrong
    (a timeout, an HTTP error) is left to the listing and its retries."""
    from huggingface_hub.utils import get_session

    try:
        get_session().head(endpoint, timeout=10)
    except Exception as exc:  # requests' ConnectionError or httpx's ConnectError
        names = {kind.__name__ for kind in type(exc).__mro__}
        return not names & {"ConnectError", "ConnectionError"} or "Timeout" in type(exc).__name__
    return True


def _cached(hub_id: HubId, revision: str | None) -> Path:
    """What the cache holds for ``hub_id`` at ``revision`` (no network): its snapshot
    folder, laid out as huggingface_hub documents its cache (refs/<revision> names the
    commit; snapshots/<commit> holds the files)."""
    from huggingface_hub import constants

    # (its folder as huggingface_hub names it: file_download.repo_folder_name, whose
    # module would import the HTTP client, 0.13 s of an offline start)
    repo = Path(constants.HF_HUB_CACHE) / ("models--" + hub_id.repo_id.replace("/", "--"))
    ref = repo / "refs" / (revision or "main")
    commit = ref.read_text().strip() if ref.is_file() else revision
    folder = repo / "snapshots" / (commit or "")
    if not commit or not folder.is_dir():
        raise _offline_error(hub_id, revision)
    files = [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]
    if hub_id.tag is None and hub_id.filename is None and "config.json" in files:
        return folder
    return folder / choose_gguf(hub_id, files)[0]


@dataclass(frozen=True)
class CachedModel:
    repo_id: str
    size_bytes: int
    formats: tuple[str, ...]  # "safetensors" and the GGUF files' quantizations
    revisions: int


def cached_models() -> list[CachedModel]:
    """The models in the hub's cache, with their sizes on disk and formats."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir()
    except CacheNotFound:
        return []
    models = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        names = {f.file_name for rev in repo.revisions for f in rev.files}
        formats = {"safetensors"} if any(n.endswith(".safetensors") for n in names) else set()
        formats |= {gguf_tag(n) or n for n in names if n.endswith(".gguf") and not _is_mmproj(n)}
        models.append(CachedModel(repo.repo_id, repo.size_on_disk, tuple(sorted(formats)),
                                  len(repo.revisions)))  # fmt: skip
    return models
