"""Small file helpers every writer shares: atomic folders and files (a crash never leaves half of one where a reader
looks), JSON in and out, checkpoint folder names."""

from __future__ import annotations

import errno
import fnmatch
import json
import logging
import os
import shutil
import socket
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import safe_open
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

logger = logging.getLogger(__name__)

#: Names inside a ``checkpoint-N`` folder (the rest are transformers').
PPO_STATE_NAME = "ppo_state.json"
CRITIC_DIR = "critic"
#: Where ``save_model`` writes the trained critic beside the policy (``save_value_model``).
VALUE_MODEL_DIR = "value_model"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_WEIGHTS_BIN = "adapter_model.bin"

#: The files whose presence says "a complete model is here"; a merge writes them last and removes them first.
MODEL_MARKERS = ("config.json", "adapter_config.json")
#: Top-level weight files of a model folder; a merge removes those of an earlier save that the new one did not write.
WEIGHT_PATTERNS = ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin", "adapter_model.*")


@contextmanager
def atomic_directory(
    final: str | os.PathLike, accelerator=None, *, merge: bool = False, owned: tuple[str, ...] = ()
) -> Iterator[str]:
    """Yield a temporary folder to write into, published as ``final`` once the block has finished (on every process,
    given an ``accelerator``): the one place trl-ppomax publishes a folder. By default it is the sibling
    ``.tmp-<name>``, renamed to ``final`` at the end (a crash leaves only it, removed by the next write; an exception
    removes it at once). With ``merge=True`` (a model saved into a folder holding other things, such as
    ``output_dir``) it is ``final/.tmp-save``, moved in by :func:`merge_model_folder` (``owned``: its subfolders
    that belong to the save), configs last."""
    final = Path(final)
    refuse_file_in_the_way(final)  # on every process, before any barrier
    temporary = final / ".tmp-save" if merge else final.with_name(f".tmp-{final.name}")
    is_main = accelerator is None or accelerator.is_main_process
    barrier = accelerator.wait_for_everyone if accelerator is not None else (lambda: None)
    if is_main:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
    barrier()
    try:
        yield str(temporary)
    except BaseException as err:
        if is_main:
            shutil.rmtree(temporary, ignore_errors=True)
        if is_disk_full(err):  # also one from a file written inside: the message names this folder
            cause = err.__cause__ if isinstance(err, DiskFullError) and err.__cause__ else err
            raise DiskFullError(disk_full_message(final, cause)) from cause
        raise
    barrier()
    if is_main:
        if merge:
            merge_model_folder(temporary, final, owned=owned)
        else:
            _replace_folder(temporary, final)
    barrier()


def _replace_folder(source: Path, target: Path) -> None:
    """Move ``source`` to ``target``; an existing ``target`` is set aside as ``.old-<name>`` until then."""
    retired = target.with_name(f".old-{target.name}")
    shutil.rmtree(retired, ignore_errors=True)
    if target.exists():
        os.replace(target, retired)
    os.replace(source, target)
    shutil.rmtree(retired, ignore_errors=True)


def merge_model_folder(source: str | os.PathLike, final: str | os.PathLike, *, owned: tuple[str, ...] = ()) -> None:
    """Move the complete model folder ``source`` into ``final`` (see :func:`atomic_directory` with ``merge``): the
    markers of ``final`` (:data:`MODEL_MARKERS`) go first, then every other entry of ``source`` replaces its namesake,
    weight files and ``owned`` subfolders (e.g. ``value_model/``) of an earlier save that the new one did not write
    are removed, and the markers come last."""
    source, final = Path(source), Path(final)
    written = {entry.name for entry in source.iterdir()}
    for name in MODEL_MARKERS:
        (final / name).unlink(missing_ok=True)
    for entry in sorted(e for e in source.iterdir() if e.name not in MODEL_MARKERS):
        (_replace_folder if entry.is_dir() else os.replace)(entry, final / entry.name)
    for stale in final.iterdir():
        weights = any(fnmatch.fnmatch(stale.name, p) for p in WEIGHT_PATTERNS)
        if weights and stale.is_file() and stale.name not in written:
            stale.unlink()
        elif stale.name in owned and stale.is_dir() and stale.name not in written:
            shutil.rmtree(stale)
    for name in MODEL_MARKERS:
        if (source / name).exists():
            os.replace(source / name, final / name)
    shutil.rmtree(source, ignore_errors=True)


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed over ``path`` when the block ends without an error
    (removed otherwise): readers see the old file or the new one, never half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield temporary
        os.replace(temporary, path)
    except Exception as err:
        if is_disk_full(err) and not isinstance(err, DiskFullError):
            temporary.unlink(missing_ok=True)
            raise DiskFullError(disk_full_message(path, err)) from err
        raise
    finally:
        temporary.unlink(missing_ok=True)


class DiskFullError(OSError):
    """A write failed because the disk is full (``ENOSPC``, or torch's ``basic_ios::clear`` / ``file write failed``);
    the message names the folder, its free space, and says that nothing was overwritten."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror


#: What torch (``torch.save``'s C++ stream writer) and safetensors say when a write runs out of space.
_DISK_FULL_MESSAGES = ("basic_ios::clear", "iostream error", "file write failed", "No space left", "StorageFull")


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` says the disk (or quota) is full: a :class:`DiskFullError`, an ``OSError`` with
    ``ENOSPC``/``EDQUOT``, or torch's or safetensors' message for a failed write (:data:`_DISK_FULL_MESSAGES`)."""
    if isinstance(error, DiskFullError) or not isinstance(error, Exception):
        return isinstance(error, DiskFullError)
    no_space = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
    return no_space or any(text in str(error) for text in _DISK_FULL_MESSAGES)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def disk_full_message(target: str | os.PathLike, error: BaseException) -> str:
    """The message of a :class:`DiskFullError` while writing ``target``: its folder, the free space there, and that
    nothing was overwritten (the atomic writers leave the previous version in place)."""
    target = Path(target)
    existing = next((p for p in (target, *target.parents) if p.exists()), Path("."))
    try:
        free = f"{_size(shutil.disk_usage(existing).free)} free"
    except OSError:
        free = "free space unknown"
    reason = " ".join(str(error).split())[:200]
    return (
        f"The disk is full: writing {target} failed ({type(error).__name__}: {reason}); {free} on the disk of "
        f"{existing}. Nothing was overwritten: what {target} held before (if anything) is intact and the partial "
        "write was removed. Free some space, or write to another disk (output_dir, or the path you save to), then "
        "save again."
    )


def write_text_atomically(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` through :func:`atomic_file`, fsynced before the rename."""
    with atomic_file(path) as temporary, temporary.open("w", encoding=encoding, newline="") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    return Path(path)


def write_json(path: str | os.PathLike, data: dict) -> Path:
    """Write ``data`` to ``path`` as indented UTF-8 JSON, atomically (:func:`write_text_atomically`)."""
    return write_text_atomically(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def read_json(path: str | os.PathLike) -> dict:
    """The JSON object in ``path``; a ValueError naming the file if it is unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"Could not read {path}: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}.")
    return data


def checkpoint_number(path: str | os.PathLike) -> int | None:
    """``N`` for a folder named exactly ``checkpoint-N`` (as transformers writes it), else None."""
    number = Path(path).name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
    return int(number) if number.isdecimal() and number != Path(path).name else None


def checkpoint_folders(folder: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-<digits>`` folders in ``folder``, smallest N first (none when ``folder`` is absent)."""
    folder = Path(folder)
    found = [p for p in folder.iterdir() if p.is_dir() and checkpoint_number(p) is not None] if folder.is_dir() else []
    return sorted(found, key=checkpoint_number)


def last_checkpoint_before(folder: str | os.PathLike, step: int | None) -> Path | None:
    """The newest ``checkpoint-N`` folder in ``folder`` with ``N < step``, or None (always None without a step)."""
    older = [p for p in checkpoint_folders(folder) if step is not None and checkpoint_number(p) < step]
    return older[-1] if older else None


def probe_writable(folder: str | os.PathLike) -> None:
    """Create ``folder`` and write and delete a file in it, or raise a ValueError naming it (before a run is lost)."""
    folder = Path(folder)
    probe = folder / f".trl-ppomax-write-test-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"trl-ppomax")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"output_dir {str(folder)!r} is not writable ({type(err).__name__}: {err.strerror or err}); the run would "
            "be lost at its first save. Set output_dir to a folder you can write to, or fix its permissions."
        ) from err


def refuse_file_in_the_way(folder: str | os.PathLike) -> None:
    """A ``NotADirectoryError`` naming the path when ``folder``, or its nearest existing parent, is a file."""
    folder = Path(folder)
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is None or existing.is_dir():
        return
    where = "is" if existing == folder else f"is under {existing}, which is"
    raise NotADirectoryError(
        f"Cannot save to {folder}: it {where} an existing file, not a folder. A model (or checkpoint) is saved as a "
        "folder of files (config.json, the weights, the tokenizer): pass the path of a folder, new or existing, or "
        "move the file away. Nothing was written."
    )


# -- One run per output_dir: an exclusive lock file, held by the main process while train() runs -----------------------
#: The lock file in ``output_dir`` (hidden, so pushes skip it); it holds the PID and host of the run holding it.
LOCK_NAME = ".trl-ppomax.lock"
#: The locks this process holds: resolved ``output_dir`` → (open lock file, owner token).
_HELD: dict[str, tuple] = {}


class OutputDirInUse(RuntimeError):
    """Another process is training in the same ``output_dir``."""


def lock_output_dir(folder: str | os.PathLike, owner: object) -> None:
    """Take the exclusive lock of ``folder`` (non-blocking ``flock`` on :data:`LOCK_NAME`) for ``owner``, or raise
    :class:`OutputDirInUse` naming the holder's PID. Released by :func:`unlock_output_dir` or at exit (a crash never
    leaves a stale lock); within one process a later owner takes it over. Unguarded where ``flock`` is unsupported."""
    try:
        import fcntl
    except ImportError:
        return
    key = os.path.realpath(folder)
    if key in _HELD:
        _HELD[key] = (_HELD[key][0], owner)
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    file = open(os.path.join(folder, LOCK_NAME), "a+", encoding="utf-8")  # noqa: SIM115 (held until unlocked)
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        file.seek(0)
        holder = file.read().strip() or "unknown"
        file.close()
        if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            logger.warning("Could not lock %s (%s): two runs in this output_dir would not be told apart.", folder, err)
            return
        pid, _, host = holder.partition(" on ")
        raise OutputDirInUse(
            f"output_dir {str(folder)!r} is in use by another training run: process {pid}"
            f"{f' on {host}' if host else ''} holds its lock file {os.path.join(folder, LOCK_NAME)}. Two runs in one "
            "output_dir would overwrite each other's checkpoints and logs. Wait for that run to end (or stop it), or "
            "set another output_dir. The lock goes with the process that holds it: no file needs deleting."
        ) from err
    file.seek(0)
    file.truncate()
    file.write(f"{os.getpid()} on {socket.gethostname()}\n")
    file.flush()
    _HELD[key] = (file, owner)


def unlock_output_dir(folder: str | os.PathLike, owner: object) -> None:
    """Release the lock :func:`lock_output_dir` took on ``folder`` for ``owner`` (nothing if another owner holds it).
    The lock file stays: removing it could let two runs lock two different files."""
    key = os.path.realpath(folder)
    held = _HELD.get(key)
    if held is None or held[1] is not owner:
        return
    del _HELD[key]
    import fcntl

    fcntl.flock(held[0], fcntl.LOCK_UN)
    held[0].close()


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The weight files of the model (or PEFT adapter) in ``folder``: one safetensors/bin file, or the shards a
    ``*.index.json`` lists. A FileNotFoundError naming what is missing when there are none or a shard is absent."""
    folder = Path(folder)
    for name in (ADAPTER_WEIGHTS, ADAPTER_WEIGHTS_BIN, SAFE_WEIGHTS_NAME, WEIGHTS_NAME):
        if (folder / name).is_file():
            return [folder / name]
    for index in (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME):
        if (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                raise FileNotFoundError(f"{folder / index} is damaged ({err}); its shards cannot be found.") from err
            missing = [shard for shard in shards if not (folder / shard).is_file()]
            if missing:
                raise FileNotFoundError(f"{folder} lacks the weight shards {missing[:5]} listed in {index}.")
            return [folder / shard for shard in shards]
    raise FileNotFoundError(
        f"No weights in {folder}: none of {SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME}, {WEIGHTS_NAME}, "
        f"{ADAPTER_WEIGHTS}."
    )


def file_problem(path: str | os.PathLike) -> str | None:
    """Why the file at ``path`` is unreadable (truncated, empty, not what its name says), or None if it looks whole.
    Cheap checks, never a full load: a safetensors header must cover the file; a ``torch.save`` file (``.pt``,
    ``.pth``, ``.bin``) must be a zip with its central directory (what a truncation cuts off); JSON an object."""
    path = Path(path)
    try:
        if path.stat().st_size == 0:
            return "the file is empty"
        if path.suffix == ".safetensors":
            with safe_open(path, "pt"):
                pass
        elif path.suffix in (".pt", ".pth", ".bin"):
            if not zipfile.is_zipfile(path):
                return "not a complete torch.save archive (truncated?)"
        elif path.suffix == ".json" and not isinstance(json.loads(path.read_text(encoding="utf-8")), dict):
            return "not a JSON object"
    except Exception as err:  # any reason the file cannot be read is the answer
        return " ".join(f"{type(err).__name__}: {err}".split())
    return None
