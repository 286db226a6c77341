"""Hugging Face Hub ids (``org/name``, ``org/name:FILE.gguf``) fetched into local checkpoints.

Only what the loaders read is downloaded. ``config.json``, ``generation_config.json``, the
tokenizer files and the safetensors index come first, so a model whose architecture jaxinfer
cannot run costs no weight download; then the weights: ``model.safetensors``, or exactly the
shards that ``model.safetensors.index.json`` lists. ``org/name:FILE.gguf`` downloads that one
GGUF file. PyTorch pickles, other GGUF files, ONNX / TensorFlow / Flax weights, READMEs and
images are never fetched.

huggingface_hub does the transfer and keeps its cache, so ``HF_TOKEN``, ``HF_HOME`` /
``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and ``HF_ENDPOINT`` mean what they mean for transformers
(huggingface_hub reads them once, when it is first imported). It moves a file into its cache
only once the whole file has arrived: a transfer cut short leaves nothing a later load could
read, and the next call downloads that file again.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Callable

from jaxinfer.errors import CheckpointError, UnknownModel

# the small files the loaders read beside the weights (tokenizer_from_hf_dir reads the tokenizer
# ones; the index names the weight shards)
METADATA_FILES = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "chat_template.jinja", "chat_template.json",
    "model.safetensors.index.json",
)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

# org/name; both parts as the Hub spells them (letters, digits, "-", "_", ".")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def parse_hub_id(name: str) -> tuple[str, str | None] | None:
    """(repo id, GGUF file or None) when ``name`` is shaped like a Hub id (``org/name`` or
    ``org/name:FILE``), else None. ``dir/file.gguf`` reads as a local path, not a repository."""
    repo, sep, file = str(name).partition(":")
    if not _REPO_ID.fullmatch(repo) or repo.endswith(".gguf") or (sep and not file):
        return None
    return repo, file or None


def download(repo_id: str, revision: str | None = None, download_dir: str | Path | None = None,
             gguf_file: str | None = None, progress: bool = True,
             check_config: Callable[[dict], object] | None = None) -> Path:
    """A local checkpoint of Hub repository ``repo_id``: the snapshot directory (config, tokenizer
    and safetensors weights), or the GGUF file when one is named (``gguf_file``, or
    ``org/name:FILE.gguf``). revision: a branch, tag or commit (default: the repository's main
    branch). download_dir: the cache to use instead of huggingface_hub's (``HF_HUB_CACHE``).
    check_config: called with ``config.json`` (a dict) before any weight is downloaded; it raises
    to refuse the model. Raises UnknownModel or CheckpointError with a one-line message."""
    if gguf_file is None and ":" in repo_id:
        repo_id, _, gguf_file = repo_id.partition(":")
    if gguf_file is not None and not gguf_file.endswith(".gguf"):
        raise UnknownModel(f"{repo_id}:{gguf_file}: only a .gguf file can be named after the repository id "
                           "(org/name:FILE.gguf)")
    import huggingface_hub as hf

    cache = str(download_dir) if download_dir is not None else None
    bars = None if progress else _quiet_bars()
    with _one_line_errors(repo_id, revision, gguf_file):
        if gguf_file is not None:
            return Path(hf.hf_hub_download(repo_id, gguf_file, revision=revision, cache_dir=cache, tqdm_class=bars))
        snapshot = Path(hf.snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                             allow_patterns=list(METADATA_FILES), tqdm_class=bars))
        config_path = snapshot / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{_where(repo_id, revision)} has no config.json"
                                  + _listing_hint(repo_id, snapshot.name))
        config = _read_json(config_path)
        if check_config is not None:
            check_config(config)
        weights = _weight_files(repo_id, snapshot)
        # the snapshot directory is named after the commit: the weights come from that same commit
        hf.snapshot_download(repo_id, revision=snapshot.name, cache_dir=cache, allow_patterns=weights,
                             tqdm_class=bars)
    missing = [w for w in weights if not (snapshot / w).is_file()]
    if missing:
        raise CheckpointError(f"{_where(repo_id, revision)}: {', '.join(missing)} did not arrive; "
                              "run again with the Hub reachable (and HF_HUB_OFFLINE unset) to fetch it")
    return snapshot


def _weight_files(repo_id: str, snapshot: Path) -> list[str]:
    """The safetensors files the loader reads: the shards the index lists, or model.safetensors."""
    index = snapshot / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{repo_id}: {INDEX_FILE} has no weight_map")
        return sorted(set(map(str, weight_map.values())))
    if (snapshot / SINGLE_FILE).is_file():  # cached by an earlier call: nothing to ask the Hub
        return [SINGLE_FILE]
    files = _repo_files(repo_id, snapshot.name)
    if files is not None and SINGLE_FILE not in files:  # None: the Hub cannot be asked; the cache may hold it
        raise CheckpointError(f"{repo_id} has no {SINGLE_FILE} or {INDEX_FILE}" + _hint(repo_id, files))
    return [SINGLE_FILE]


def _repo_files(repo_id: str, commit: str) -> set[str] | None:
    """The repository's file names at ``commit``, or None when the Hub cannot be asked (offline)."""
    import huggingface_hub as hf
    from huggingface_hub.utils import httpx

    try:
        return set(hf.HfApi().list_repo_files(repo_id, revision=commit))
    except (OSError, httpx.TransportError):  # offline mode, no connection, the Hub refusing
        return None


def _listing_hint(repo_id: str, commit: str) -> str:
    files = _repo_files(repo_id, commit)
    return _hint(repo_id, files) if files is not None else ""


def _hint(repo_id: str, files: set[str]) -> str:
    """What the repository holds instead of a transformers checkpoint, in a few words."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    pickles = sorted(f for f in files if f.endswith(_PICKLES))
    others = sorted(f for f in files if f.endswith(".safetensors"))
    said = []
    if ggufs:
        shown = ", ".join(ggufs[:4]) + (", ..." if len(ggufs) > 4 else "")
        said.append(f"it holds GGUF files: name one as {repo_id}:FILE.gguf ({shown})")
    if pickles:
        said.append(f"its PyTorch weights ({', '.join(pickles[:3])}) are not read: jaxinfer loads only "
                    "safetensors and GGUF checkpoints")
    if others:
        said.append(f"its safetensors files ({', '.join(others[:3])}) are not in the transformers layout")
    return "; " + "; ".join(said) if said else "; it has no weights jaxinfer reads (safetensors or GGUF)"


@contextlib.contextmanager
def _one_line_errors(repo_id: str, revision: str | None, gguf_file: str | None):
    """huggingface_hub's errors (several lines each) as one line that says what to do."""
    from huggingface_hub import errors
    from huggingface_hub.utils import httpx

    where = _where(repo_id, revision)
    try:
        yield
    except errors.GatedRepoError:
        raise CheckpointError(
            f"{repo_id} is a gated repository: accept its terms on its Hub page, then set HF_TOKEN to an access "
            "token of that account" + (" (the token set now has no access)" if _token_set() else "")) from None
    except errors.RepositoryNotFoundError:
        raise UnknownModel(
            f"no Hugging Face Hub repository {repo_id!r} (and no local path of that name); if it is private, "
            "set HF_TOKEN to an access token that can read it") from None
    except errors.RevisionNotFoundError:
        raise UnknownModel(f"{repo_id} has no revision {revision!r} (a branch, tag or commit)") from None
    except errors.LocalEntryNotFoundError as e:  # offline, or the Hub unreachable, and not cached
        reason = "HF_HUB_OFFLINE is set" if _offline() else "the Hub cannot be reached"
        cause = f" ({_first_line(e.__cause__)})" if e.__cause__ is not None and not _offline() else ""
        raise CheckpointError(f"{where} is not (fully) in the Hugging Face cache and {reason}{cause}") from None
    except errors.EntryNotFoundError:
        raise CheckpointError(f"{where} has no file {gguf_file or 'that its listing names'}"
                              + (_listing_hint(repo_id, revision or "main") if gguf_file else "")) from None
    except errors.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise CheckpointError(f"the Hugging Face Hub answered HTTP {status} for {where}: {_first_line(e)}") from None
    except httpx.TransportError as e:
        raise CheckpointError(
            f"downloading {where} failed: {_first_line(e)}; files that arrived whole are cached, "
            "run again to fetch the rest") from None
    except errors.HFValidationError as e:
        raise UnknownModel(f"{repo_id!r} is not a valid Hugging Face Hub id: {_first_line(e)}") from None
    except OSError as e:  # a size check that failed, a full disk, an unwritable cache
        raise CheckpointError(f"downloading {where} failed: {_first_line(e)}") from None


def _where(repo_id: str, revision: str | None) -> str:
    return repo_id if revision is None else f"{repo_id} (revision {revision!r})"


def _first_line(e) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def _token_set() -> bool:
    from huggingface_hub import get_token

    return get_token() is not None


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _quiet_bars():
    """A tqdm class that draws nothing (huggingface_hub's bars, when progress=False)."""
    from tqdm.auto import tqdm

    class Quiet(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Quiet
