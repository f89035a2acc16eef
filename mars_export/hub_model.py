"""A model named by its Hugging Face hub id (``owner/name``), resolved to a checkpoint directory in the hub cache.

MODEL may be a hub id, as transformers' ``from_pretrained`` takes it, and ``--revision`` picks a branch, tag or
commit (a separate option, as vLLM, TGI and ``hf download`` spell it). :func:`fetch_snapshot` downloads with
``huggingface_hub.snapshot_download`` only what loading a causal LM reads: the config, the tokenizer files and
the safetensors weights (torch's ``.bin`` weights only where a repository has no safetensors; never its GGUF or
ONNX files), into the hub cache (``HF_HOME``, ``HF_HUB_CACHE``), and honours ``HF_HUB_OFFLINE``. The snapshot is
then loaded as any checkpoint directory. A local path always wins: a string is a hub id only where no file or
directory of that name exists. Torch-free; huggingface_hub is imported only for a hub id, so the argument
checks of the commands stay quick.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

DEFAULT_REVISION = "main"
# What loading a checkpoint reads, as snapshot_download's allow_patterns (fnmatch: a pattern without "*" before
# its first "/" matches top-level files only).
CONFIG_AND_TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                              "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                              "vocab.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
SAFETENSORS_FILES = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json")
TORCH_WEIGHT_FILES = ("pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HubSnapshot:
    """A hub model resolved to its snapshot in the local cache.

    Attributes:
        repo_id: ``owner/name``.
        revision: the branch, tag or commit asked for (``main`` unless ``--revision`` says otherwise).
        commit: the commit hash it resolved to (the name of the snapshot folder).
        path: the snapshot folder, ``HF_HUB_CACHE/models--owner--name/snapshots/COMMIT``: a checkpoint directory.
    """

    repo_id: str
    revision: str
    commit: str
    path: Path

    @property
    def source(self) -> str:
        """How a bundle records it (``source_model``): the id, the revision asked for and the commit that fetches
        the same weights again."""
        asked = "" if self.revision == self.commit else f"revision {self.revision}, "
        return f"{self.repo_id} (Hugging Face hub, {asked}commit {self.commit})"


def is_hub_id(spec: str) -> bool:
    """True where ``spec`` is spelled as a hub model id (``owner/name``, by huggingface_hub's rules) and no file or
    directory of that name exists (a local path wins). A ``.gguf`` name is a file's, never an id."""
    return not Path(spec).exists() and is_spelled_as_hub_id(spec)


def is_spelled_as_hub_id(spec: str) -> bool:
    """True where ``spec`` is spelled as a hub model id (``owner/name``, by huggingface_hub's rules; not a ``.gguf``
    name), whether or not a local path of that name exists."""
    if spec.count("/") != 1 or spec.endswith(".gguf"):
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def check_revision(spec: str, revision: str | None) -> None:
    """Raise ValueError where ``revision`` (``--revision``) is given for a model that is no hub id."""
    if revision is not None and not is_hub_id(spec):
        raise ValueError(f"--revision {revision} picks a version of a Hugging Face hub model, but {spec!r} is "
                         "no hub id (owner/name naming no local path): drop --revision")


def repo_cache_folder(repo_id: str) -> Path:
    """The hub cache's folder of the model ``repo_id`` (its ``blobs/``, ``refs/`` and ``snapshots/``), whether
    it exists yet or not."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name
    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")


def fetch_snapshot(repo_id: str, revision: str | None = None) -> HubSnapshot:
    """The snapshot of ``repo_id`` at ``revision`` (default ``main``), downloading into the hub cache what
    loading needs and is not there yet; from the cache alone where the hub cannot be reached. Logs (INFO) the
    commit it resolved to, as ``mars-export`` prints it.

    Raises:
        ValueError: one line naming the id: not in the cache and the hub unreachable (saying how to fix it),
            no such repository or revision on the hub, a gated repository, another hub error, or a snapshot
            without ``config.json`` (no transformers checkpoint).
    """
    revision = revision or DEFAULT_REVISION
    path = _download(repo_id, revision, CONFIG_AND_TOKENIZER_FILES + SAFETENSORS_FILES)
    if not any(path.glob("*.safetensors")):  # an older repository: torch's .bin weights only
        path = _download(repo_id, revision, CONFIG_AND_TOKENIZER_FILES + TORCH_WEIGHT_FILES)
    if not (path / "config.json").is_file():
        raise ValueError(f"cannot load model {repo_id!r}: its hub repository has no config.json, so it is no "
                         "transformers checkpoint (a GGUF-only repository? download its .gguf file and pass that)")
    snapshot = HubSnapshot(repo_id, revision, path.name, path)
    log.info("model %s", snapshot.source)
    return snapshot


def _download(repo_id: str, revision: str, allow_patterns: tuple[str, ...]) -> Path:
    """``snapshot_download``'s folder, its errors turned into one ValueError line each."""
    from huggingface_hub import constants, errors, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    # a LocalEntryNotFoundError that recent huggingface_hub releases raise; older ones have no such class
    incomplete_snapshot = getattr(errors, "IncompleteSnapshotError", ())
    which, flag = (repr(repo_id), "") if revision == DEFAULT_REVISION else \
        (f"{repo_id!r} at revision {revision!r}", f" --revision {revision}")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(allow_patterns)))
    except RevisionNotFoundError as e:
        raise ValueError(f"cannot load model {repo_id!r}: the Hugging Face hub has no revision {revision!r} of it "
                         "(give a branch, tag or commit of the repository as --revision)") from e
    except GatedRepoError as e:
        raise ValueError(f"cannot load model {repo_id!r}: it is gated on the Hugging Face hub; accept its terms on "
                         "its page and log in (hf auth login), or download it and pass its directory") from e
    except RepositoryNotFoundError as e:
        raise ValueError(f"cannot load model {repo_id!r}: no such file or directory, and no model of that id on "
                         "the Hugging Face hub (a private one needs hf auth login)") from e
    except incomplete_snapshot as e:
        raise ValueError(f"cannot load model {which}: its snapshot in the local Hugging Face cache misses files "
                         "and the hub could not be reached; connect to the network and run again") from e
    except LocalEntryNotFoundError as e:
        why = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise ValueError(f"cannot load model {which}: no such file or directory, and as a Hugging Face hub id it "
                         f"is not in the local cache ({constants.HF_HUB_CACHE}) and the hub could not be "
                         f"reached{why}; connect to the network and run again, or download it where you can "
                         f"(hf download {repo_id}{flag}) and pass its directory") from e
    except HfHubHTTPError as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load model {which} from the Hugging Face hub: {first_line[:300]}") from e
